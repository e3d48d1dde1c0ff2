"""How sources travel to spawn/forkserver workers: default pickler, pickle_by_value, dill."""

import pickle
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from extsrc import ParallelSource, PoolSpec, SourcePicklingError, pickle_by_value
from extsrc.engine.pickling import DefaultPickler, Pickler


def first_value(src):
    with src:
        return int(next(iter(src))[0][0])


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_default_pickler_carries_lambdas_and_closures(method):
    offset = np.array([100])
    closure = lambda info: offset + info.idx_in_epoch  # noqa: E731
    assert first_value(ParallelSource(closure, 2, start_method=method)) == 100


def test_functions_defined_in_python_dash_c_reach_spawned_workers():
    code = textwrap.dedent(
        """
        import numpy as np, extsrc
        scale = 3
        def source(info):
            return np.array([info.idx_in_epoch * scale])
        with extsrc.ParallelSource(source, 4, num_workers=2, start_method="spawn") as src:
            print([int(s[0]) for s in next(iter(src))])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 3, 6, 9]"


def _module_outside_the_workers_path(tmp_path, monkeypatch):
    (tmp_path / "hidden_helpers.py").write_text(
        "import numpy as np\n"
        "def source(info):\n"
        "    return np.array([info.idx_in_epoch + 7])\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    import hidden_helpers

    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    return hidden_helpers


def test_pickle_by_value_sends_a_function_whose_module_workers_cannot_import(tmp_path, monkeypatch):
    helpers = _module_outside_the_workers_path(tmp_path, monkeypatch)
    with pytest.raises(RuntimeError, match="could not load the sources.*hidden_helpers"):
        first_value(ParallelSource(helpers.source, 2, start_method="spawn"))
    assert first_value(ParallelSource(pickle_by_value(helpers.source), 2, start_method="spawn")) == 7


def test_pickle_by_value_rejects_non_functions():
    with pytest.raises(TypeError, match="expects a Python function"):
        pickle_by_value(len)


def test_dill_with_keyword_arguments():
    dill = pytest.importorskip("dill")
    base = np.array([5])
    src = ParallelSource(lambda info: base * 2, 2, pool=PoolSpec(start_method="spawn", pickler=(dill, {"recurse": True})))
    assert first_value(src) == 10


def test_pickler_keyword_arguments_reach_dumps():
    import pickle

    src = ParallelSource(np.zeros, 2, pool=PoolSpec(start_method="spawn", pickler=(pickle, {"not_an_option": 1})))
    # The pickler's own error comes as it is (DALI lets it through too), noting where it came from.
    with pytest.raises(TypeError, match="not_an_option") as caught:
        src.start()
    assert "raised by pickler 'pickle'" in "".join(getattr(caught.value, "__notes__", []))
    src.close()


def test_unpicklable_source_fails_at_start_naming_the_object_and_the_fixes():
    lock = threading.Lock()

    def source(info):
        with lock:
            return np.zeros(1)

    src = ParallelSource(source, 2, start_method="spawn")
    with pytest.raises(SourcePicklingError) as caught:
        src.start()
    message = str(caught.value)
    assert "lock" in message and "pickle_by_value" in message and "fork" in message
    src.close()


def test_invalid_pickler_is_rejected_early():
    with pytest.raises(TypeError, match="dumps"):
        ParallelSource(np.zeros, 2, pool=PoolSpec(pickler=object()))


def test_core_import_loads_numpy_only():
    code = (
        "import sys, extsrc; heavy = {'cloudpickle', 'dill', 'torch', 'nvidia.dali', 'cupy', 'PIL'};"
        "print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


class _RefusingMore(DefaultPickler):
    """A default pickler that refuses more when pickling (as the DALI drop-in's does)."""

    @staticmethod
    def dumps(obj):
        return DefaultPickler.dumps(obj)


class _LoadingItsOwnWay(DefaultPickler):
    @staticmethod
    def loads(data):
        return ("loaded", pickle.loads(data))


def test_a_worker_gets_the_default_pickler_when_a_subclass_changes_only_dumps():
    # Workers only load: a subclass changing dumps alone need not be imported there (the
    # drop-in's pickler module would import DALI in every spawned worker).
    assert pickle.loads(pickle.dumps(Pickler(_RefusingMore))).impl is DefaultPickler
    rebuilt = pickle.loads(pickle.dumps(Pickler(_LoadingItsOwnWay)))
    assert rebuilt.impl is _LoadingItsOwnWay
    assert rebuilt.loads(pickle.dumps(3)) == ("loaded", 3)


def test_a_copy_of_a_pickler_pickles_as_the_original():
    # A copy is no worker's: it keeps the subclass that changes dumps, and its own arguments.
    import copy

    original = Pickler((_RefusingMore, {"protocol": 4}))
    for copied in (copy.copy(original), copy.deepcopy(original)):
        assert copied.impl is _RefusingMore and copied.dumps_kwargs == {"protocol": 4}
        copied.dumps_kwargs["protocol"] = 2
        assert original.dumps_kwargs == {"protocol": 4}
