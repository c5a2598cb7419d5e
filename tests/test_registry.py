"""Registries: lazy targets, duplicates, entry points, availability and errors."""

import importlib.metadata
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvkit.registry as registry_module
from kvkit.errors import BackendUnavailableError, ConfigError
from kvkit.interfaces import EvictionPolicy, ExplainsUnavailability, ReportsAvailability
from kvkit.registry import COPY, ENTRY_POINT_GROUP, EVICTION, STORE, Registry

POLICY_SOURCE = textwrap.dedent('''
    from kvkit.testing.doubles import InertPolicy

    class FakePolicy(InertPolicy):
        def __init__(self, capacity=0):
            self.capacity = capacity

    class Unavailable(FakePolicy):
        @classmethod
        def is_available(cls): return False

    class Explained(Unavailable):
        @staticmethod
        def unavailable_reason(): return "no frobnicator on this machine"

    class BrokenProbe(FakePolicy):
        @classmethod
        def is_available(cls): raise OSError("driver exploded")

    def not_a_policy():
        return "just a string"

    NOT_CALLABLE = 42
''')

BUILTINS = {
    "eviction": {
        "lru": "kvkit.backends.eviction.lru:LRUPolicy",
        "fifo": "kvkit.backends.eviction.fifo:FIFOPolicy",
        "lfu": "kvkit.backends.eviction.lfu:LFUPolicy",
        "arc": "kvkit.backends.eviction.arc:ARCPolicy",
        "s3fifo": "kvkit.backends.eviction.s3fifo:S3FIFOPolicy",
        "opt": "kvkit.backends.eviction.opt:OptimalPolicy",
    },
    "store": {
        "eager": "kvkit.backends.store.eager:EagerStore",
        "lazy": "kvkit.backends.store.lazy:LazyStore",
        "selective": "kvkit.backends.store.selective:SelectiveStore",
        "never": "kvkit.backends.store.never:NeverStore",
    },
    "copy": {
        "torch": "kvkit.backends.copy.torch_copy:TorchCopy",
        "cuda-dma": "kvkit.backends.copy.cuda_dma:CudaDMACopy",
        "cupy-batch": "kvkit.backends.copy.cupy_batch:CupyBatchCopy",
        "auto": "kvkit.backends.copy.auto:AutoCopy",
        "staged": "kvkit.backends.copy.staged:StagedCopy",
    },
    "allocator": {"pool": "kvkit.backends.allocator.pool:BlockPool"},
    "shared": {
        "memory": "kvkit.backends.blockstore.memory:MemoryStore",
        "disk": "kvkit.backends.blockstore.disk:DiskStore",
        "valkey": "kvkit.backends.blockstore.valkey:ValkeyStore",
    },
    "planner": {
        "overlap": "kvkit.backends.plan.overlap:OverlapPlanner",
        "load-all": "kvkit.backends.plan.overlap:LoadAllPlanner",
    },
}


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """A uniquely named importable module holding fake policies; yields its name."""
    name = f"kvkit_fake_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(POLICY_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def fake_entry_points(monkeypatch, *pairs):
    """Make ``importlib.metadata.entry_points`` report ``(name, value)`` pairs in kvkit's group."""
    entries = [importlib.metadata.EntryPoint(name=n, value=v, group=ENTRY_POINT_GROUP) for n, v in pairs]

    def entry_points(**selection):
        assert selection == {"group": ENTRY_POINT_GROUP}
        return entries

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


@pytest.fixture
def fresh(monkeypatch):
    """An empty eviction registry in an environment without kvkit entry points."""
    fake_entry_points(monkeypatch)
    return Registry("eviction", EvictionPolicy, "eviction policy")


def test_builtin_names_and_targets():
    """Every built-in name maps to its documented lazy target."""
    for reg in registry_module.REGISTRIES.values():
        for name, target in BUILTINS[reg.kind].items():
            assert name in reg.names()
            assert reg.target(name) == target
        reg.check_invariants()
    assert list(registry_module.REGISTRIES) == ["eviction", "store", "copy", "allocator", "shared", "planner"]


def test_lazy_target_not_imported_until_used(fresh, fake_module):
    """A 'module:Class' target is imported by load, not by register, names or target."""
    fresh.register("fake", f"{fake_module}:FakePolicy")
    assert fresh.names() == ["fake"] and fresh.target("fake") == f"{fake_module}:FakePolicy"
    assert fake_module not in sys.modules
    cls = fresh.load("fake")
    assert fake_module in sys.modules and cls.__name__ == "FakePolicy"
    fresh.check_invariants()


def test_import_kvkit_registry_imports_no_backend():
    """Importing kvkit and listing names imports no backend module."""
    code = ("import sys, kvkit.registry as r\n"
            "[reg.names() for reg in r.REGISTRIES.values()]\n"
            "print([m for m in sys.modules if m.startswith('kvkit.backends.')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_duplicate_rejected_override_accepted(fresh, fake_module):
    """A taken name raises ConfigError quoting it; override=True replaces the target and its cache."""
    fresh.register("fake", f"{fake_module}:FakePolicy")
    fresh.load("fake")
    with pytest.raises(ConfigError, match=r"'fake' is already registered.*override=True"):
        fresh.register("fake", f"{fake_module}:Unavailable")
    fresh.register("fake", f"{fake_module}:Unavailable", override=True)
    assert fresh.load("fake").__name__ == "Unavailable"
    fresh.check_invariants()


@pytest.mark.parametrize(("name", "target"), [
    ("", "a:B"), ("a:b", "a:B"), (" x", "a:B"), (3, "a:B"),
    ("x", "no_colon"), ("x", ":B"), ("x", "a:"), ("x", 42), ("x", "a b:C"),
])
def test_register_rejects_malformed(fresh, name, target):
    """Malformed names and targets raise ConfigError quoting the bad value."""
    with pytest.raises(ConfigError) as info:
        fresh.register(name, target)
    assert repr(name) in str(info.value) or repr(target) in str(info.value)
    assert fresh.names() == []


def test_unknown_name_lists_valid_and_close_match():
    """An unknown name raises ConfigError quoting it, listing every valid name and the closest one."""
    with pytest.raises(ConfigError) as info:
        EVICTION.load("lur")
    message = str(info.value)
    assert "'lur'" in message and "did you mean 'lru'?" in message
    assert all(name in message for name in EVICTION.names())


@given(st.text(max_size=12))
def test_unknown_names_always_list_valid_names(name):
    """For any unregistered string, load raises ConfigError naming it and every valid name."""
    if name in COPY.names():
        return
    with pytest.raises(ConfigError) as info:
        COPY.load(name)
    assert repr(name) in str(info.value)
    assert all(valid in str(info.value) for valid in COPY.names())


@given(st.one_of(st.text(max_size=8), st.integers(), st.none(), st.lists(st.integers(), max_size=2)))
def test_available_never_raises(name):
    """available() answers a bool for any argument, never raising."""
    assert isinstance(STORE.available(name), bool)


def test_availability_reasons(fresh, fake_module):
    """Import failures, False probes and raising probes make a name unavailable, with a reason."""
    fresh.register("ok", f"{fake_module}:FakePolicy")
    fresh.register("missing", "kvkit_definitely_missing_module:Policy")
    fresh.register("no_attr", f"{fake_module}:Nope")
    fresh.register("off", f"{fake_module}:Unavailable")
    fresh.register("probe", f"{fake_module}:BrokenProbe")
    fresh.register("explained", f"{fake_module}:Explained")
    fresh.register("constant", f"{fake_module}:NOT_CALLABLE")
    assert fresh.available("ok") and fresh.why_unavailable("ok") is None
    assert "ModuleNotFoundError" in fresh.why_unavailable("missing")
    assert "AttributeError" in fresh.why_unavailable("no_attr")
    assert "is_available() returned False" in fresh.why_unavailable("off")
    assert "driver exploded" in fresh.why_unavailable("probe")
    assert fresh.why_unavailable("explained").endswith(": no frobnicator on this machine")
    assert "not a class or factory" in fresh.why_unavailable("constant")
    assert not fresh.available("unregistered")
    with pytest.raises(BackendUnavailableError, match="'missing'"):
        fresh.load("missing")
    with pytest.raises(BackendUnavailableError, match=r"'off'.*returned False"):
        fresh.create("off")
    fresh.check_invariants()


def test_availability_capabilities_are_read_off_the_class(fresh, fake_module):
    """The registry probes a class through ReportsAvailability / ExplainsUnavailability; None opts out."""
    fresh.register("explained", f"{fake_module}:Explained")
    explained = fresh.load("explained")
    module = sys.modules[fake_module]
    assert isinstance(explained, ExplainsUnavailability) and isinstance(explained, ReportsAvailability)
    assert isinstance(module.Unavailable, ReportsAvailability)
    assert not isinstance(module.Unavailable, ExplainsUnavailability)
    assert not isinstance(module.FakePolicy, ReportsAvailability)
    silent = type("Silent", (module.Explained,), {"unavailable_reason": None})
    assert not isinstance(silent, ExplainsUnavailability)
    fresh.register("silent", silent)
    assert fresh.why_unavailable("silent").endswith("Silent.is_available() returned False")
    for name in ("cuda-dma", "cupy-batch", "auto", "staged"):
        assert isinstance(COPY.load(name), ExplainsUnavailability), name


def test_failed_import_is_retried(fresh, fake_module, tmp_path):
    """A module that appears after a failed import makes the name available (failures are not cached)."""
    fresh.register("late", "kvkit_late_module:FakePolicy")
    assert not fresh.available("late")
    (tmp_path / "kvkit_late_module.py").write_text(POLICY_SOURCE)
    importlib.invalidate_caches()
    try:
        assert fresh.available("late")
    finally:
        sys.modules.pop("kvkit_late_module", None)


def test_create_from_name_and_instance(fresh, fake_module):
    """create builds a name with kwargs and returns a protocol-satisfying instance unchanged."""
    fresh.register("fake", f"{fake_module}:FakePolicy")
    policy = fresh.create("fake", capacity=3)
    assert isinstance(policy, EvictionPolicy) and policy.capacity == 3
    assert fresh.create(policy) is policy


def test_create_rejects_wrong_objects(fresh, fake_module):
    """Wrong objects raise ConfigError naming the slot, the object's type and the protocol."""
    fresh.register("fake", f"{fake_module}:FakePolicy")
    fresh.register("bad_factory", f"{fake_module}:not_a_policy")
    with pytest.raises(ConfigError, match=r"gpu_eviction=.*dict is not a EvictionPolicy"):
        fresh.create({"a": 1}, slot="gpu_eviction")
    cls = fresh.load("fake")
    with pytest.raises(ConfigError, match=r"got a class.*FakePolicy\(\)"):
        fresh.create(cls)
    with pytest.raises(ConfigError, match=r"options .*capacity"):
        fresh.create(cls(), capacity=2)
    with pytest.raises(ConfigError, match=r"'fake'.*options.*'size'"):
        fresh.create("fake", size=2)
    with pytest.raises(ConfigError, match="built a str, which is not a EvictionPolicy"):
        fresh.create("bad_factory")


def test_entry_points_are_registered_lazily(fresh, fake_module, monkeypatch):
    """Entry points of this kind are read on first use and import nothing until loaded."""
    fake_entry_points(monkeypatch, ("eviction.plugged", f"{fake_module}:FakePolicy"),
                      ("store.other", f"{fake_module}:FakePolicy"))
    reg = Registry("eviction", EvictionPolicy, "eviction policy")
    assert reg.names() == ["plugged"]
    assert fake_module not in sys.modules
    assert reg.available("plugged") and reg.problems == []
    with pytest.raises(ConfigError, match="already registered"):
        reg.register("plugged", f"{fake_module}:FakePolicy")


def test_bad_entry_points_are_reported_not_fatal(monkeypatch, fake_module):
    """Malformed, clashing, unknown-kind and unimportable entry points become problems or unavailable names."""
    fake_entry_points(
        monkeypatch,
        ("eviction.lru", f"{fake_module}:FakePolicy"),      # clashes with a built-in
        ("eviction.broken", "not a target"),                 # malformed value
        ("eviction.ghost", "kvkit_no_such_plugin:Policy"),   # cannot be imported
        ("evction.typo", f"{fake_module}:FakePolicy"),       # unknown kind
        ("nodot", f"{fake_module}:FakePolicy"),              # no kind at all
    )
    regs = {kind: Registry(kind, reg.protocol, reg.label, builtins=dict(BUILTINS[kind]))
            for kind, reg in registry_module.REGISTRIES.items()}
    monkeypatch.setattr(registry_module, "REGISTRIES", regs)
    problems = registry_module.entry_point_problems()
    text = "\n".join(problems)
    assert len(problems) == 4, problems
    assert "'evction.typo'" in text and "did you mean 'eviction'?" in text
    assert "'nodot'" in text and "'eviction.broken'" in text and "'eviction.lru'" in text
    assert regs["eviction"].target("lru") == BUILTINS["eviction"]["lru"]
    assert "ghost" in regs["eviction"].names() and not regs["eviction"].available("ghost")


def test_unreadable_entry_points_are_a_problem(monkeypatch):
    """Broken package metadata is reported as a problem, never raised."""
    def entry_points(**selection):
        raise RuntimeError("corrupt METADATA")

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    reg = Registry("copy", COPY.protocol, "copy backend", builtins={"torch": BUILTINS["copy"]["torch"]})
    assert reg.names() == ["torch"]
    assert any("corrupt METADATA" in p for p in reg.problems)


def test_entry_point_from_installed_distribution(tmp_path, monkeypatch, fake_module):
    """A distribution on sys.path declaring a kvkit.backends entry point adds its name."""
    info = tmp_path / "kvkit_fakeplugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvkit-fakeplugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\neviction.fake_lru = {fake_module}:FakePolicy\n")
    reg = Registry("eviction", EvictionPolicy, "eviction policy")
    assert reg.names() == ["fake_lru"]
    assert isinstance(reg.create("fake_lru"), EvictionPolicy)
