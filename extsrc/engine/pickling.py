"""How a source travels to ``spawn``/``forkserver`` workers.

With ``fork`` nothing is pickled: workers inherit the source. Otherwise the
pool pickles all its sources once, at start, with the pool's pickler, and each
worker unpickles them once.

The default pickler is cloudpickle (imported only when needed): it carries
lambdas, closures and functions defined in ``__main__`` by value, including
``python -c`` and notebooks, where ``__main__`` has no file to import in the
worker. Everything importable travels by reference.
"""

from __future__ import annotations

import collections.abc
import copy
import importlib
import inspect
import io
import pickle
import sys
import types
from typing import Any, Callable, Dict, Optional, Protocol, Tuple, Type, TypeVar

from extsrc.errors import SourcePicklingError

_BY_VALUE_FLAG = "_extsrc_pickle_by_value"

F = TypeVar("F", bound=Callable[..., object])


def pickle_by_value(fn: F) -> F:
    """Marks ``fn`` to be pickled by value (its code, not its import path).

    Use it for a module-level function whose module cannot be imported in a
    spawned worker (e.g. a helper module next to a notebook). Only the default
    pickler honours the mark. Returns ``fn`` itself, so it works as a
    decorator. Raises ``TypeError`` if ``fn`` is not a Python function.
    """
    if not isinstance(fn, types.FunctionType):
        raise TypeError(
            f"pickle_by_value expects a Python function, got {type(fn).__name__} {fn!r}"
        )
    setattr(fn, _BY_VALUE_FLAG, True)
    return fn


def _by_value_pickler_class() -> Type[pickle.Pickler]:
    import cloudpickle

    class _Pickler(cloudpickle.Pickler):
        def reducer_override(self, obj: object) -> object:
            if isinstance(obj, types.FunctionType) and getattr(obj, _BY_VALUE_FLAG, False):
                return self._dynamic_function_reduce(obj)
            if isinstance(obj, types.CodeType) and obj.co_filename != _FILENAME_CARRIED:
                # cloudpickle (3.1.3 on) names every code object it carries "<dynamic-code>":
                # the worker's tracebacks would lose the file and its source lines.
                return _with_filename, (obj.replace(co_filename=_FILENAME_CARRIED), obj.co_filename)
            return super().reducer_override(obj)

    return _Pickler


# The file name a code object carries while cloudpickle pickles it; its own travels beside it.
_FILENAME_CARRIED = "<extsrc: file name restored on load>"


def _with_filename(code: types.CodeType, filename: str) -> types.CodeType:
    """``code`` (unpickled in a worker) with the file name it had where it was defined."""
    return code.replace(co_filename=filename)


class DefaultPickler:
    """cloudpickle for ``dumps`` (honouring :func:`pickle_by_value`), ``pickle.loads`` to load.

    A subclass keeps what the default pickler promises (everything of ``__main__`` travels by
    value, so workers do not run the main script again) and may refuse more: it can build on
    :meth:`pickler_class`.
    """

    @staticmethod
    def pickler_class() -> Type[pickle.Pickler]:
        """The ``cloudpickle.Pickler`` subclass ``dumps`` uses (for subclasses to extend)."""
        return _by_value_pickler_class()

    @staticmethod
    def dumps(obj: object) -> bytes:
        buffer = io.BytesIO()
        _by_value_pickler_class()(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()

    @staticmethod
    def loads(data: bytes) -> Any:  # whatever was pickled
        return pickle.loads(data)


def dumps_classes_by_path(obj: object) -> bytes:
    """``obj`` pickled with each class by reference wherever its module holds it (by name, as
    a class body's attribute, or under another name: ``Pair = namedtuple("Pair", ...)`` in a
    class body, which pickle alone refuses), and by value where no module does (a class made
    in a function: a class of the same name and fields, not the same class). For small
    descriptions made once and read by many processes, e.g. a sample's structure."""
    try:
        buffer = io.BytesIO()
        _ClassByPathPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        return buffer.getvalue()
    except (pickle.PicklingError, AttributeError, TypeError):
        return DefaultPickler.dumps(obj)


class _ClassByPathPickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> Any:  # a reduce value, or NotImplemented (untyped)
        if not isinstance(obj, type) or _held_at(obj.__module__, obj.__qualname__) is obj:
            return NotImplemented
        path = _path_in_module(obj)
        return NotImplemented if path is None else (attribute_at, (obj.__module__, path))


def _held_at(module_name: str, path: str) -> object:
    """``module_name.path`` (dotted) of an imported module, or ``None`` where there is none."""
    value: object = sys.modules.get(module_name)
    for part in path.split("."):
        value = getattr(value, part, None)
    return value


def _path_in_module(cls: type) -> Optional[str]:
    """Where ``cls``'s module holds it: a module attribute, or one of a module class's."""
    module = sys.modules.get(cls.__module__)
    for name, value in list(vars(module).items()) if module is not None else ():
        if value is cls:
            return name
        if isinstance(value, type):
            for inner, member in list(vars(value).items()):
                if member is cls:
                    return f"{name}.{inner}"
    return None


# What a user may pass as ``pickler=`` (resolved once into a :class:`Pickler`): ``None``, a
# module or object with ``dumps``/``loads`` (``pickle``, ``dill``, ``cloudpickle``, one's own),
# a ``(pickler, dumps_kwargs[, loads_kwargs])`` tuple, or a ``Pickler``. Any: modules and
# objects with differing signatures all fit; Pickler() checks what it got.
PicklerSpec = Any
# The keyword arguments of a pickler's dumps or loads (the pickler's own).
PicklerKwargs = Dict[str, Any]


class Serializer(Protocol):
    """What a ``Pickler`` wraps: a module or object with ``dumps`` and ``loads`` (``pickle``,
    ``dill``, ``cloudpickle``, :class:`DefaultPickler`, one's own). ``loads`` gives what was
    pickled."""

    @property
    def dumps(self) -> Callable[..., bytes]: ...

    @property
    def loads(self) -> Callable[..., Any]: ...


class Pickler:
    """A resolved ``pickler=`` argument: ``dumps``/``loads`` with their keyword arguments.

    Accepts ``None`` (the default pickler), a module or object with ``dumps``
    and ``loads`` (``pickle``, ``dill``, ``cloudpickle``, your own), or a tuple
    ``(pickler, dumps_kwargs)`` / ``(pickler, dumps_kwargs, loads_kwargs)``,
    e.g. ``(dill, {"recurse": True})``. Raises ``TypeError`` for anything else.

    A ``Pickler`` is itself picklable with the standard pickle module (a module
    travels by name), so a spawned worker can rebuild it to load the sources.
    """

    def __init__(self, spec: PicklerSpec = None):
        dumps_kwargs: PicklerKwargs = {}
        loads_kwargs: PicklerKwargs = {}
        if isinstance(spec, tuple):
            if not 1 <= len(spec) <= 3:
                raise TypeError(
                    "pickler tuple must be (pickler, dumps_kwargs[, loads_kwargs]), "
                    f"got a tuple of {len(spec)} items"
                )
            spec, dumps_kwargs, loads_kwargs = (tuple(spec) + ({}, {}))[:3]
            for label, kwargs in (("dumps_kwargs", dumps_kwargs), ("loads_kwargs", loads_kwargs)):
                if not isinstance(kwargs, dict):
                    raise TypeError(f"pickler {label} must be a dict, got {type(kwargs).__name__}")
        if spec is None:
            spec = DefaultPickler
        if not (callable(getattr(spec, "dumps", None)) and callable(getattr(spec, "loads", None))):
            raise TypeError(
                "pickler must be a module or object with dumps() and loads() "
                f"(e.g. pickle, dill, cloudpickle), got {spec!r}"
            )
        self.impl: Serializer = spec
        self.dumps_kwargs = dict(dumps_kwargs)
        self.loads_kwargs = dict(loads_kwargs)

    @property
    def by_value_main(self) -> bool:
        """Whether everything defined in ``__main__`` travels by value (the default pickler)."""
        return isinstance(self.impl, type) and issubclass(self.impl, DefaultPickler)

    @property
    def name(self) -> str:
        impl = self.impl
        return getattr(impl, "__name__", type(impl).__name__)

    def dumps(self, obj: object, what: str = "source") -> bytes:
        """Pickles ``obj``; raises :class:`SourcePicklingError` naming ``what`` and the fixes.

        An exception of a pickler given by the user that is not a ``PicklingError`` (e.g. a
        ``ValueError`` about its arguments) is raised as it is, with a note naming ``what``.
        """
        try:
            return self.impl.dumps(obj, **self.dumps_kwargs)
        except Exception as exc:
            if not self.by_value_main and not isinstance(exc, pickle.PicklingError):
                # The user's own pickler raised something of its own (a ValueError about its
                # arguments, ...): it reaches the user as it is, with where it happened.
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"(extsrc: raised by pickler {self.name!r} pickling the {what} "
                                 f"{_short_repr(obj)} for spawned workers)")
                raise
            if inspect.isgenerator(obj):
                raise SourcePicklingError(
                    f"cannot pickle the {what} {_short_repr(obj)} for spawned workers: it is a "
                    "generator object, which no pickler can carry. Pass the generator function "
                    "itself (source=gen, not source=gen()); each epoch then calls it anew."
                ) from exc
            raise SourcePicklingError(
                f"cannot pickle the {what} {_short_repr(obj)} for workers started with spawn "
                f"or on Ray, with pickler {self.name!r}: {type(exc).__name__}: {exc}\n"
                "Fixes: define the callback at module level in an importable module, "
                "mark it with extsrc.pickle_by_value, pass a pickler that serialises more "
                'by value (e.g. pickler=(dill, {"recurse": True})), make the object picklable '
                "(defer unpicklable state to __setstate__), or, with worker processes, fork "
                "them (start_method='fork'; py_start_method='fork' in pipeline_def; "
                "multiprocessing_context='fork' in extsrc.torch.from_dataset)."
            ) from exc

    def loads(self, data: bytes) -> Any:  # whatever was pickled
        return self.impl.loads(data, **self.loads_kwargs)

    def __copy__(self) -> "Pickler":
        # Not through __reduce__, which gives what a worker needs: a copy here must pickle too.
        copied = type(self).__new__(type(self))
        copied.__dict__.update(self.__dict__)
        copied.dumps_kwargs, copied.loads_kwargs = dict(self.dumps_kwargs), dict(self.loads_kwargs)
        return copied

    def __deepcopy__(self, memo: Dict[int, object]) -> "Pickler":
        copied = self.__copy__()
        memo[id(self)] = copied
        copied.dumps_kwargs = copy.deepcopy(self.dumps_kwargs, memo)
        copied.loads_kwargs = copy.deepcopy(self.loads_kwargs, memo)
        return copied

    def __reduce__(self) -> Tuple[Callable[[object, PicklerKwargs, PicklerKwargs], "Pickler"],
                                  Tuple[object, PicklerKwargs, PicklerKwargs]]:
        # What a worker gets: it only loads. A subclass of DefaultPickler that changes only
        # dumps travels as DefaultPickler, so that the worker need not import the subclass's
        # module (the DALI layer's would import DALI: about 0.35 s per spawned worker).
        impl: object = self.impl
        if isinstance(impl, types.ModuleType):
            impl = _ModuleRef(impl.__name__)
        elif (isinstance(impl, type) and issubclass(impl, DefaultPickler)
              and impl.loads is DefaultPickler.loads):
            impl = DefaultPickler
        return (_rebuild_pickler, (impl, self.dumps_kwargs, self.loads_kwargs))


class _ModuleRef:
    def __init__(self, name: str):
        self.name = name


def _rebuild_pickler(impl: object, dumps_kwargs: PicklerKwargs, loads_kwargs: PicklerKwargs) -> Pickler:
    if isinstance(impl, _ModuleRef):
        impl = importlib.import_module(impl.name)
    return Pickler((impl, dumps_kwargs, loads_kwargs))


def _short_repr(obj: object, limit: int = 120) -> str:
    try:
        text = repr(obj)
    except Exception:
        text = f"<{type(obj).__name__} object>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -- exceptions, worker -> consumer -------------------------------------------------------------


def dumps_exception(exc: BaseException) -> Optional[bytes]:
    """``exc`` pickled for the consumer, or ``None`` if it cannot travel.

    A class of ``__main__`` travels by its name, to be found in the
    consumer's ``__main__``: under spawn/forkserver a worker has the class
    (rebuilt by value with the callback) but not the consumer's main module,
    so a plain pickle would fail in the worker, and one by value would make
    a class of its own that ``except`` in the consumer does not catch. An
    exception that a plain pickle cannot rebuild (its ``__init__`` wants
    arguments its ``args`` lack, as urllib's ``HTTPError``; an attribute
    that does not pickle, as the headers of aiohttp's
    ``ClientResponseError``) travels as its class, ``args`` and attributes,
    rebuilt without ``__init__``; what of those does not pickle travels as
    plain data (:func:`_portable`), so that ``except HTTPError as e:
    e.code`` still works in the consumer. The consumer falls back to
    :class:`~extsrc.errors.CallbackError` when the payload does not load
    there (:func:`loads_exception`).
    """
    of_main = type(exc).__module__ == "__main__"
    picklers: Tuple[Type[pickle.Pickler], ...] = (
        (_MainByNamePickler, _RebuildingPickler) if of_main else (pickle.Pickler, _RebuildingPickler))
    for pickler in picklers:
        try:
            buffer = io.BytesIO()
            pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(exc)
            payload = buffer.getvalue()
            if not of_main:  # what loads here loads in the consumer (a class of __main__ cannot)
                pickle.loads(payload)
            return payload
        except Exception:
            continue
    return None


def loads_exception(payload: bytes) -> Optional[BaseException]:
    """What :func:`dumps_exception` made, in the consumer; ``None`` if it does not load here."""
    try:
        error = pickle.loads(payload)
    except Exception:
        return None
    return error if isinstance(error, BaseException) else None


class _MainByNamePickler(pickle.Pickler):
    def reducer_override(self, obj: object) -> Any:  # a reduce value, or NotImplemented (untyped)
        if (isinstance(obj, type) and obj.__module__ == "__main__"
                and "<locals>" not in obj.__qualname__):
            return _main_attribute, (obj.__qualname__,)
        return NotImplemented


class _RebuildingPickler(_MainByNamePickler):
    """Pickles the exception being dumped as its class, ``args`` and attributes, made portable
    (see :func:`dumps_exception`)."""

    def reducer_override(self, obj: object) -> Any:
        if isinstance(obj, BaseException) and not getattr(self, "_rebuilding", False):
            self._rebuilding = True  # the exception itself only, not one among its attributes
            state = {name: _portable(value) for name, value in vars(obj).items()}
            return _rebuilt_exception, (type(obj), _portable(obj.args), state)
        return super().reducer_override(obj)


def _rebuilt_exception(cls: type, args: Any, state: Dict[str, Any]) -> BaseException:
    """An exception of ``cls`` with ``args`` and the attributes ``state``, made without its
    ``__init__`` (which may want what did not travel)."""
    error: BaseException = cls.__new__(cls, *args)
    error.args = tuple(args)
    error.__dict__.update(state)
    return error


def _portable(value: Any, depth: int = 4) -> Any:
    """``value`` if it pickles; else a namedtuple, list or tuple of portable items, a dict of a
    mapping's, and at the last (or ``depth`` levels down) the value's ``repr``."""
    try:
        pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        return value
    except Exception:
        pass
    if depth > 0:
        try:
            if isinstance(value, tuple) and hasattr(type(value), "_fields"):
                return type(value)(*(_portable(item, depth - 1) for item in value))
            if type(value) in (list, tuple):
                return type(value)(_portable(item, depth - 1) for item in value)
            if isinstance(value, collections.abc.Mapping):
                return {key: _portable(item, depth - 1) for key, item in value.items()}
        except Exception:
            pass
    return repr(value)


def _main_attribute(qualname: str) -> object:
    """``__main__.<qualname>`` of the process loading the pickle."""
    return attribute_at("__main__", qualname)


def attribute_at(module_name: str, path: str) -> object:
    """``module_name.path`` (a dotted path), the module imported if it is not yet: what a pickle
    that names an object by where its module holds it loads."""
    value: object = importlib.import_module(module_name)
    for part in path.split("."):
        value = getattr(value, part)
    return value
