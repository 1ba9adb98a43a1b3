"""``_env``: the ``MFUWATCH_KERNELS_*`` switches and the Triton interpreter's index fix."""

import types

import pytest

from mfuwatch.kernels import _env


@pytest.mark.parametrize("raw,expected", [(" 0 ", False), ("OFF", False), ("no", False), ("1", True),
                                          (" Yes", True), ("", True)])
def test_env_flags_accept_the_documented_values(monkeypatch, raw, expected):
    monkeypatch.setenv("MFUWATCH_TEST_FLAG", raw)
    assert _env.env_flag("MFUWATCH_TEST_FLAG", True) is expected


def test_env_flag_with_an_unknown_value_warns_and_keeps_the_default(monkeypatch):
    monkeypatch.setenv("MFUWATCH_TEST_FLAG", "disable")
    with pytest.warns(UserWarning, match=r"MFUWATCH_TEST_FLAG='disable' is not one of 1/true/on/yes or "
                                         r"0/false/off/no; using the default \(on\)"):
        assert _env.env_flag("MFUWATCH_TEST_FLAG", True) is True


def test_interpreter_index_fix_backports_the_squeeze_only_where_needed(monkeypatch):
    """Triton <= 3.6's interpreter does ``int(one_element_array)``, a TypeError under NumPy >= 2.4.

    The fix wraps the interpreter's tensor patching so that ``__index__`` squeezes first, and only for
    Triton < 3.7 with NumPy >= 2.4 (the whole kernel suite was run against Triton 3.6.0 this way).
    """
    np = pytest.importorskip("numpy")
    triton = pytest.importorskip("triton")
    ti = pytest.importorskip("triton.runtime.interpreter")
    monkeypatch.setattr(_env, "INTERPRET", True)
    monkeypatch.setattr(ti, "_mfuwatch_index_fix", False, raising=False)
    calls = []

    def original(tensor, scope):  # Triton 3.6's behaviour: int() of the raw (1,)-shaped array
        calls.append(tensor)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    monkeypatch.setattr(ti, "_patch_lang_tensor", original)

    class Scope:
        def set_attr(self, obj, name, value):
            setattr(obj, name, value)

    class T:
        pass

    scalar = T()
    scalar.handle = types.SimpleNamespace(data=np.array([7], dtype=np.int32))

    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert _env.interpreter_index_fix() is False and ti._patch_lang_tensor is original

    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(np, "__version__", "2.3.5")
    assert _env.interpreter_index_fix() is False and ti._patch_lang_tensor is original

    monkeypatch.setattr(np, "__version__", "2.4.0")
    assert _env.interpreter_index_fix() is True
    ti._patch_lang_tensor(T, Scope())
    assert calls == [T]  # the original still runs: everything else it patches is kept
    assert range(scalar)[-1] == 6  # range() calls __index__: 7 from the (1,)-shaped array
    assert _env.interpreter_index_fix() is False  # applied once


def test_interpreter_index_fix_is_off_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(_env, "INTERPRET", False)
    assert _env.interpreter_index_fix() is False
