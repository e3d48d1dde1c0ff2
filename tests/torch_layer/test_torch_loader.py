"""extsrc.torch.TorchLoader on the CPU: tensors over shared memory, len(), state dicts, lifetime."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from extsrc import Order, ParallelSource
from extsrc.torch import TorchLoader

from sources import StopsAt, two_outputs


def stamped(info):
    """Sample: [record, epoch] (int64) and 1 KiB of the record's low byte."""
    return (np.array([info.record, info.epoch_idx], np.int64),
            np.full((1024,), info.record % 251, np.uint8))


def _extsrc_ranges():
    ranges = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            if "extsrc:" in line:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                ranges.append((start, end))
    return ranges


def test_batches_are_tensors_viewing_the_shared_memory():
    with ParallelSource(stamped, 8, num_outputs=2, num_workers=2, order=Order(40)) as source:
        loader = TorchLoader(source)
        records = []
        for i, (ids, payload) in enumerate(loader):
            assert isinstance(ids, torch.Tensor) and ids.dtype == torch.int64 and ids.shape == (8, 2)
            assert payload.dtype == torch.uint8 and payload.shape == (8, 1024)
            assert (payload == (ids[:, :1] % 251).to(torch.uint8)).all()
            records += ids[:, 0].tolist()
            mapped = _extsrc_ranges()
            # Zero copy, after the first batch of each worker (dispatched before the first results
            # tell the layout, their samples are gathered into one dense tensor).
            for tensor in (ids, payload):
                assert any(start <= tensor.data_ptr() < end for start, end in mapped) or i < 2
        assert records == list(range(40))


def test_ragged_outputs_are_lists_of_tensors_and_several_outputs_a_tuple():
    with ParallelSource(two_outputs, 4, num_outputs=2, num_workers=2, order=Order(8)) as source:
        batches = list(TorchLoader(source))
    assert len(batches) == 2
    for images, ragged in batches:
        assert isinstance(images, torch.Tensor) and images.shape == (4, 2, 3)
        assert isinstance(ragged, list) and [t.tolist() for t in ragged] == [
            list(range(k + 1)) for k in range(4)
        ]


def test_len_is_the_sources_and_needs_an_order():
    with ParallelSource(stamped, 8, num_outputs=2, order=Order(30), last_batch="partial") as source:
        assert len(TorchLoader(source)) == 4 == len(list(TorchLoader(source)))
    with ParallelSource(StopsAt(10), 4) as source:
        with pytest.raises(TypeError, match="order="):
            len(TorchLoader(source))


def _records(batches):
    return [b[0][:, 0].tolist() for b in batches]


def test_state_dict_resumes_at_the_next_batch_in_a_new_process_state():
    order = Order(64, shuffle=True, seed=5)
    with ParallelSource(stamped, 8, num_outputs=2, num_workers=2, order=order) as source:
        loader = TorchLoader(source)
        list(loader)  # epoch 0
        epoch = iter(loader)
        first = [next(epoch) for _ in range(3)]
        state = loader.state_dict()
        rest = list(epoch)
        after_epoch = loader.state_dict()
    saved = json.loads(json.dumps(state))  # what torch.save / a checkpoint file keeps
    assert saved["epoch_idx"] == 1 and saved["iteration"] == 3
    assert after_epoch["epoch_idx"] == 2 and after_epoch["iteration"] == 0
    with ParallelSource(stamped, 8, num_outputs=2, num_workers=2, order=order) as source:
        resumed = TorchLoader(source)
        resumed.load_state_dict(saved)
        again = list(resumed)
    assert _records(again) == _records(rest)
    assert _records(first + rest) == [list(order.epoch(1))[i:i + 8] for i in range(0, 64, 8)]
    assert all((b[0][:, 1] == 1).all() for b in again)


def test_state_dict_of_another_order_is_refused():
    with ParallelSource(stamped, 8, num_outputs=2, order=Order(64, shuffle=True, seed=1)) as source:
        state = TorchLoader(source).state_dict()
    with ParallelSource(stamped, 8, num_outputs=2, order=Order(64, shuffle=True, seed=2)) as source:
        with pytest.raises(ValueError, match="order"):
            TorchLoader(source).load_state_dict(state)


def test_tensors_kept_stay_right_while_the_loop_goes_on():
    with ParallelSource(stamped, 4, num_outputs=2, num_workers=2, order=Order(400)) as source:
        epoch = iter(TorchLoader(source))
        kept = [next(epoch) for _ in range(20)]
        views = [payload[1:3] for _ids, payload in kept]  # views of tensors, without the batch
        del kept
        for _ in range(60):  # the memory of dropped batches is reused meanwhile
            next(epoch)
    for i, view in enumerate(views):
        assert (view == torch.tensor([(4 * i + 1) % 251, (4 * i + 2) % 251], dtype=torch.uint8)[:, None]).all()


def test_a_new_loop_starts_the_next_epoch_after_a_break_and_the_state_follows():
    with ParallelSource(stamped, 4, num_outputs=2, order=Order(12)) as source:
        loader = TorchLoader(source)
        for _ in loader:
            break
        assert loader.state_dict()["epoch_idx"] == 0 and loader.state_dict()["iteration"] == 1
        epoch = iter(loader)
        assert loader.state_dict()["epoch_idx"] == 1 and loader.state_dict()["iteration"] == 0
        first = next(epoch)
        assert loader.state_dict()["epoch_idx"] == 1 and loader.state_dict()["iteration"] == 1
        epochs = [first[0][:, 1].tolist()] + [b[0][:, 1].tolist() for b in epoch]
    assert epochs == [[1] * 4] * 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error where CUDA is missing")
@pytest.mark.parametrize("kwargs, what", [(dict(pin_memory=True), "pin_memory=True"),
                                          (dict(device="cuda"), "device='cuda'")])
def test_asking_for_cuda_without_it_is_a_clear_error(kwargs, what):
    with ParallelSource(StopsAt(10), 4, num_workers=1) as source:
        with pytest.raises(RuntimeError, match=rf"{what} needs CUDA.*is_available\(\) is False"):
            TorchLoader(source, **kwargs)
        assert [b[0][0] for b in source] == [0, 4]  # the source still works


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(device="mps"), ValueError, "CPU or a CUDA device"),
    (dict(device="nonsense"), ValueError, "device must be"),
    (dict(pin_memory=1), TypeError, "pin_memory must be True or False"),
])
def test_invalid_arguments_are_refused(kwargs, error, match):
    with ParallelSource(StopsAt(10), 4) as source:
        with pytest.raises(error, match=match):
            TorchLoader(source, **kwargs)


def big_endian_second(info):
    n = 1 + info.idx_in_epoch % 3  # ragged: one tensor per sample
    return np.arange(2), (np.arange(n) + info.idx_in_epoch).astype(">f4")


def test_big_endian_samples_are_refused_naming_the_output_and_the_conversion():
    # torch.from_numpy's own ValueError names neither the output nor what to do.
    with ParallelSource(big_endian_second, 4, num_outputs=2) as source:
        with pytest.raises(TypeError, match=r"output 1 of the batch, sample 0, has dtype float32 "
                                            r"\(big-endian, '>f4'\).*x.astype\(x.dtype.newbyteorder"):
            next(iter(TorchLoader(source)))


def test_a_loader_needs_a_parallel_source():
    with pytest.raises(TypeError, match="extsrc.ParallelSource, got list"):
        TorchLoader([np.zeros(3)])


def test_a_loop_ended_by_a_newer_one_raises_instead_of_stopping_early():
    with ParallelSource(stamped, 4, num_outputs=2, order=Order(12)) as source:
        loader = TorchLoader(source)
        first = iter(loader)
        next(first)
        second = iter(loader)  # one loop at a time: this ends the first one's epoch
        with pytest.raises(RuntimeError, match=r"ended by a newer iter\(loader\).*one loop at a time"):
            next(first)
        assert [b[0][0, 1].item() for b in second] == [1, 1, 1]  # the newer loop has its whole epoch
        with pytest.raises(RuntimeError, match="one loop at a time"):
            list(zip(loader, loader))  # not an empty list
        third = iter(loader)
        next(third)
        loader.load_state_dict(loader.state_dict())
        with pytest.raises(RuntimeError, match=r"load_state_dict\(\)"):
            next(third)


def test_a_layer_reads_the_loops_position_and_ends_the_loop_in_its_own_words():
    with ParallelSource(stamped, 4, num_outputs=2, order=Order(12)) as source:
        loader = TorchLoader(source)
        assert loader.position is None  # no loop yet
        loop = iter(loader)
        next(loop)
        position = loader.position
        assert (position.epoch_idx, position.finished, position.ended_by) == (0, False, None)
        assert (loader.state_dict()["epoch_idx"], loader.state_dict()["iteration"]) == (0, 1)
        loader.end_loop("a restart of the workers")
        with pytest.raises(RuntimeError, match="ended by a restart of the workers before the end"):
            next(loop)
        assert [b[0][0, 1].item() for b in loader] == [1, 1, 1]  # the next loop: the next epoch, whole


def test_a_loop_over_a_closed_loader_raises_instead_of_stopping_early():
    with ParallelSource(stamped, 4, num_outputs=2, order=Order(12)) as source:
        loader = TorchLoader(source)
        epoch = iter(loader)
        next(epoch)
        loader.close()
        loader.close()  # idempotent
        with pytest.raises(ValueError, match="this TorchLoader is closed"):
            next(epoch)
        with pytest.raises(ValueError, match="this TorchLoader is closed"):
            iter(loader)


def test_an_interrupt_while_a_batch_becomes_tensors_loses_no_batch(monkeypatch):
    import extsrc.torch.loader as loader_module

    real, calls = loader_module.batch_tensors, []

    def interrupted_once(batch):
        calls.append(1)
        if len(calls) == 3:  # a KeyboardInterrupt arriving after the source handed the batch over
            raise KeyboardInterrupt
        return real(batch)

    monkeypatch.setattr(loader_module, "batch_tensors", interrupted_once)
    with ParallelSource(stamped, 4, num_outputs=2, num_workers=2, order=Order(24)) as source:
        loader = TorchLoader(source)
        epoch = iter(loader)
        records = []
        interrupts = 0
        while True:
            try:
                ids, _payload = next(epoch)
            except KeyboardInterrupt:
                interrupts += 1
                assert loader.state_dict()["iteration"] == 2  # still points at the batch not given
                continue
            except StopIteration:
                break
            records += ids[:, 0].tolist()
    assert interrupts == 1
    assert records == list(range(24))  # the interrupted batch came with the next call


def test_two_loaders_on_one_source_raise_instead_of_sharing_its_batches():
    with ParallelSource(stamped, 4, num_outputs=2, num_workers=2, order=Order(40)) as source:
        a, b = TorchLoader(source), TorchLoader(source)
        loop_a = iter(a)
        first_a = next(loop_a)
        loop_b = iter(b)
        next(loop_b)
        with pytest.raises(RuntimeError, match="one loop at a time"):
            next(loop_a)  # before: a silently short epoch for A
        assert int(first_a[0][0, 0]) == 0


def test_a_state_dict_of_another_batch_size_resumes_exactly_or_is_refused():
    with ParallelSource(stamped, 4, num_outputs=2, num_workers=2, order=Order(40)) as source:
        loader = TorchLoader(source)
        it = iter(loader)
        for _ in range(3):
            next(it)
        state = loader.state_dict()  # after 12 records
    with ParallelSource(stamped, 6, num_outputs=2, num_workers=2, order=Order(40)) as source:
        resumed = TorchLoader(source)
        resumed.load_state_dict(state)
        ids, _ = next(iter(resumed))
        assert ids[:, 0].tolist() == list(range(12, 18))
    with ParallelSource(stamped, 8, num_outputs=2, num_workers=2, order=Order(40)) as source:
        with pytest.raises(ValueError, match="not a batch boundary"):
            TorchLoader(source).load_state_dict(state)


# close() cut short by a Ctrl-C at each place one can land in the PyTorch layer's close steps,
# then called again with the loader still held: the second call finishes the job (before, the
# first marked the loader closed on entry and the second returned at once, leaving the workers).
# A map-style dataset's loader and an IterableDataset's. In its own interpreter.
_INTERRUPTED_CLOSES = '''
import _thread, os
import torch
import extsrc
from extsrc.torch import from_dataset
from interrupting import cut_at_landing
from procs import live_children

TORCH_LAYER = os.path.join(os.path.dirname(extsrc.__file__), "torch")


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, index):
        return torch.tensor([index * index])


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        return iter(range(info.id, 16, info.num_workers))


threads = _thread._count()
for dataset in (Squares(), Counting()):
    walked = interrupted = 0
    while True:
        walked += 1
        loader = from_dataset(dataset, batch_size=4, num_workers=2)
        next(iter(loader))
        cut, over = cut_at_landing(walked, TORCH_LAYER, loader.close)
        interrupted += cut
        loader.close()
        assert live_children() == [], (type(dataset).__name__, walked, live_children())
        assert _thread._count() == threads, (type(dataset).__name__, walked, _thread._count())
        del loader
        if over:
            break
    print(type(dataset).__name__, "WALKED", walked > 3, "INTERRUPTED", interrupted == walked - 1)
'''


def test_a_close_interrupted_wherever_a_ctrl_c_can_land_is_finished_by_the_next_close():
    from faultkit import run_isolated

    result = run_isolated(_INTERRUPTED_CLOSES, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for kind in ("Squares", "Counting"):
        assert f"{kind} WALKED True INTERRUPTED True" in result.stdout, result.stdout
