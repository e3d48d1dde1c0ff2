"""Tutorial 13: data-parallel training on 2 ranks with torchrun, each rank its own shard.

Launch with PyTorch's launcher, on the CPU:

    torchrun --nproc_per_node=2 tutorials/13_data_parallel_torchrun.py [OUT_DIR]

Each rank builds its own pipeline with ``Order(..., shard="auto")``, which
reads ``RANK`` and ``WORLD_SIZE`` as torchrun sets them. The ranks then see
disjoint records, all shuffled from one global order per epoch, and the same
number of batches (``remainder="pad"``, ``last_batch="pad"``), so no rank
waits for another at the gradient all-reduce. A tiny model is trained on the
decoded images with gradients averaged over the ranks (gloo).

Halfway through the second epoch each rank saves a DALI checkpoint, finishes
the epoch, then builds a new pipeline from the checkpoint and checks that it
gives exactly the batches that followed: same records, same random draws.
Without torchrun the script runs as a single rank.

Run: ``torchrun --nproc_per_node=2 tutorials/13_data_parallel_torchrun.py [OUT_DIR]``
(or ``python tutorials/13_data_parallel_torchrun.py [OUT_DIR] [--gpu]``)
"""

import json
import os
from importlib.resources import files

import numpy as np
import torch
import torch.distributed as dist
from nvidia.dali import types

import extsrc
from extsrc import fn, pipeline_def

import tutorial_io

DATA_DIR = str(files("extsrc") / "data")
BATCH_SIZE = 8
EPOCHS = 2
SIZE = 32  # images are resized to SIZE x SIZE for the model


class RecordReader:
    """Loads ``info.record``; ``info.rng`` decides a random brightness (an augmentation)."""

    def __init__(self, data_dir: str):
        self.image_dir = os.path.join(data_dir, "images")
        with open(os.path.join(data_dir, "labels.txt")) as f:
            self.samples = [(name, int(label)) for name, label in (line.split() for line in f)]

    def __len__(self) -> int:
        return len(self.samples)

    def __call__(self, info):
        name, label = self.samples[info.record]
        with open(os.path.join(self.image_dir, name), "rb") as f:
            encoded = np.frombuffer(f.read(), dtype=np.uint8)
        brightness = np.array([info.rng.uniform(0.8, 1.2)], dtype=np.float32)
        return encoded, np.array([label], dtype=np.int32), np.array([info.record], dtype=np.int64), brightness


@pipeline_def(batch_size=BATCH_SIZE, num_threads=1, py_num_workers=2, enable_checkpointing=True)
def train_pipeline(source, order, decoder_device):
    jpegs, labels, records, brightness = fn.external_source(
        source=source, num_outputs=4, batch=False, parallel=True, order=order, last_batch="pad",
        dtype=[types.UINT8, types.INT32, types.INT64, types.FLOAT],
    )
    images = fn.decoders.image(jpegs, device=decoder_device, output_type=types.RGB)
    images = fn.resize(images, resize_x=SIZE, resize_y=SIZE)
    images = fn.brightness(images, brightness=brightness[0])
    return images, labels, records


def run_epoch(pipe, on_batch):
    """Runs ``pipe`` to the end of its epoch, calling ``on_batch(images, labels, records)``."""
    batches = 0
    try:
        while True:
            images, labels, records = pipe.run()
            on_batch(images, labels, records)
            batches += 1
    except StopIteration:
        pipe.reset()
    return batches


def as_numpy(tensor_list):
    tensor_list = tensor_list.as_cpu()
    return np.stack([np.array(tensor_list[i]) for i in range(len(tensor_list))])


def main(argv=None):
    args = tutorial_io.parse_args(__doc__, argv)
    distributed = "RANK" in os.environ
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    reader = RecordReader(DATA_DIR)
    order = extsrc.Order(len(reader), shuffle=True, seed=11, shard="auto", remainder="pad")
    device, device_id = tutorial_io.decoder_device(args)

    torch.manual_seed(0)  # the same initial model on every rank
    model = torch.nn.Linear(SIZE * SIZE * 3, 10)
    optimiser = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {"images": [], "labels": [], "records": [], "checkpoint": None}

    def train_step(images, labels, records):
        x = torch.from_numpy(as_numpy(images).reshape(BATCH_SIZE, -1).astype(np.float32) / 255)
        y = torch.from_numpy(as_numpy(labels).reshape(-1).astype(np.int64))
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimiser.zero_grad()
        loss.backward()
        if distributed:
            for p in model.parameters():  # average the gradients over the ranks
                dist.all_reduce(p.grad)
                p.grad /= world
        optimiser.step()
        seen["records"].append(as_numpy(records).reshape(-1).tolist())
        seen["images"].append(as_numpy(images))

    pipe = train_pipeline(reader, order, device, device_id=device_id)
    pipe.build()
    batches = run_epoch(pipe, train_step)
    epoch0_records = [r for batch in seen["records"] for r in batch]
    first_images = [image for batch in seen["images"] for image in batch]
    first_labels = [reader.samples[r][1] for r in epoch0_records]

    # Epoch 1: a checkpoint after the first batch, then the rest of the epoch.
    seen["records"] = []
    state = {"after": []}

    def step_and_checkpoint(images, labels, records):
        train_step(images, labels, records)
        if seen["checkpoint"] is None:
            seen["checkpoint"] = pipe.checkpoint()
        else:
            state["after"].append((seen["records"][-1], as_numpy(images)))

    run_epoch(pipe, step_and_checkpoint)
    pipe.close()

    resumed = train_pipeline(reader, order, device, device_id=device_id, checkpoint=seen["checkpoint"])
    resumed.build()
    again = []
    run_epoch(resumed, lambda images, labels, records: again.append(
        (as_numpy(records).reshape(-1).tolist(), as_numpy(images))))
    resumed.close()
    resumed_same = len(again) == len(state["after"]) and all(
        r1 == r2 and np.array_equal(i1, i2) for (r1, i1), (r2, i2) in zip(again, state["after"]))

    if distributed:  # every rank's records of epoch 0, to show they are disjoint
        gathered = [None] * world
        dist.all_gather_object(gathered, epoch0_records)
        counts = [None] * world
        dist.all_gather_object(counts, batches)
    else:
        gathered, counts = [epoch0_records], [batches]
    overlap = set(gathered[0]).intersection(*map(set, gathered[1:])) if world > 1 else set()
    print(f"rank {rank} of {world}: {batches} batches per epoch, records {epoch0_records[:6]}..., "
          f"resumed exactly: {resumed_same}")
    if rank == 0:
        print(f"batches per rank {counts}; records shared by ranks: {sorted(overlap) or 'none'}")

    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world_size": world, "batches": batches,
                       "records": epoch0_records, "resumed_same": resumed_same}, f)
        if rank == 0:
            tutorial_io.save(args.out, __file__, first_images, first_labels, records=epoch0_records)
    if distributed:
        dist.barrier()  # no rank tears its connections down while another still talks to it
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
