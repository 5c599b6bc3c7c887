"""Shared fixtures: encode-side connector peers and language-side managers, and the test tiers.

A connector test runs over real Mooncake with the encode peer in its own process; a module
marked ``transports("mooncake", "memory")`` runs each of its tests a second time with both
sides in this process over :class:`MemoryTransport` (same interface, same failure behaviour),
and that copy belongs to the fast tier. ``fast`` tests stay in this process: starting a
subprocess from one fails it."""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
COMPILE_OFF = "TORCH_COMPILE_DISABLE"  # what torch reads at its import
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]  # the harness package; the scripts the tests run too
# Workers started by SGLang's launcher are forked from a process that imported it once
# (harness/worker_zygote.py): 1-3 s a start instead of 13-15 s here. EPD_FORK_WORKERS=0 starts
# each one fresh.
os.environ.setdefault("EPD_FORK_WORKERS", "1")
# The workers' default mmap threshold (1 MiB, --malloc-mmap-threshold: flat memory over many
# requests, at the cost of page faults on every large buffer) is worth about a tenth of the
# suite's CPU; the suite's workers live minutes, so they take glibc's largest fixed threshold
# instead. tests/test_heap.py checks the default; scripts/bench_memory.py measures it.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(32 << 20))
# SGLang's vision rotary is torch.compile'd: about 3 s of CPU at an encoder's first forward pass,
# and more at each new shape. Its eager rows are the compiled ones, bit for bit
# (tests/test_sglang_encoder_rows.py), so the suite's workers run it eagerly; the modules that
# check the path users run (SGLang's encoder against transformers and upstream, the main job)
# take the compiled one (the ``compiled_torch`` fixture).
os.environ.setdefault(COMPILE_OFF, "1")
# Hub ids resolve in a Hugging Face cache of the run's own, offline (tests install checkpoints there:
# harness/hub_cache.py): set before the zygote imports huggingface_hub, which reads it then.
if "HF_HUB_CACHE" not in os.environ:  # the run's own (xdist's workers inherit it), removed at its end
    os.environ["HF_HUB_CACHE"] = os.path.join(tempfile.gettempdir(), f"epd-tests-hf-hub-{os.getpid()}")
    atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], ignore_errors=True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import zmq  # noqa: E402
from hypothesis import settings  # noqa: E402
from make_checkpoint import write_checkpoint  # noqa: E402
from request_watchdog import RequestWatchdog  # noqa: E402

from connector.allocator import BlockAllocator  # noqa: E402
from connector.buffers import BufferPool  # noqa: E402
from connector.config import ConnectorConfig  # noqa: E402
from connector.memory_transport import MemoryTransport  # noqa: E402
from connector.messages import (  # noqa: E402
    LanguageBound,
    PingMsg,
    PongMsg,
    RegisterMsg,
    StatusMsg,
    decode_language_bound,
)
from connector.mooncake_transport import MooncakeTransport  # noqa: E402
from connector.poll import KVPoll  # noqa: E402
from connector.receiver import EmbeddingReceiverManager  # noqa: E402
from harness import worker_zygote  # noqa: E402
from harness.peer_control import EncodePeer, InProcessPeer  # noqa: E402
from harness.workers import LIVE, dump_live_workers  # noqa: E402

CONNECTOR_KINDS = ("mooncake", "memory")
# No per-example deadline: an example is not timed (a run beside a serial test, starved for a
# second, took 368 ms for one that takes 0.3 ms).
settings.register_profile("untimed", deadline=None)
settings.load_profile("untimed")
WATCHDOG = RequestWatchdog(dump_live_workers)
# Tests that time what they watch (a failure within a heartbeat window, an answer within a few
# seconds) get the machine to themselves under pytest-xdist: two never overlap, and while one runs,
# its processes are at the highest CPU priority, so the other worker's tests go on with what it
# leaves of the two cores (most of these tests wait for a heartbeat, a cut or a timeout). Without
# the right to raise a priority (CAP_SYS_NICE), the other worker waits instead. (Soaks assert exact
# outputs and memory, not time: they share the machine, as the load tests that assert completion
# only do.)
SERIAL_MARKERS = ("serial", "faults")
SERIAL_NICE = -20  # the other worker's processes, at 0, get about 1% of a core a timed test wants
BASE_NICE = os.getpriority(os.PRIO_PROCESS, 0)  # what pytest was started at (0 unless under `nice`)


class SerialLock:
    """A lock the xdist workers share through files: ``serial`` tests take it exclusively, every
    other test shares it (only where priorities cannot be raised). A serial test that waits holds the
    gate, so no new test starts before it (it is not starved by a stream of shared holders)."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self._gate, self._main = folder / "gate.lock", folder / "main.lock"

    @contextmanager
    def hold(self, exclusive: bool) -> Iterator[None]:
        with open(self._gate, "a") as gate, open(self._main, "a") as main:
            fcntl.flock(gate, fcntl.LOCK_EX)
            try:
                fcntl.flock(main, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            finally:
                fcntl.flock(gate, fcntl.LOCK_UN)
            try:
                yield
            finally:
                fcntl.flock(main, fcntl.LOCK_UN)


def _can_raise_priority() -> bool:
    try:
        os.setpriority(os.PRIO_PROCESS, 0, SERIAL_NICE)
    except PermissionError:
        return False
    os.setpriority(os.PRIO_PROCESS, 0, BASE_NICE)
    return True


PRIORITIES_RAISED = _can_raise_priority()


def _set_priority(nice: int) -> None:
    """Every thread of this process, of the processes it started and of the workers forked for it (and
    their children), at CPU priority ``nice``; threads and workers started later inherit it (a fork
    from the zygote too: harness/worker_zygote.py)."""
    for root in [os.getpid(), *(worker.proc.pid for worker in list(LIVE))]:
        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(root)
            for process in [tree, *tree.children(recursive=True)]:
                for thread in process.threads():
                    with contextlib.suppress(ProcessLookupError):
                        os.setpriority(os.PRIO_PROCESS, thread.id, nice)


def _serial(item: pytest.Item | None) -> bool:
    return item is not None and any(item.get_closest_marker(name) for name in SERIAL_MARKERS)


class ExclusiveRun:
    """The exclusive hold a serial test's call takes (and the raised priority), kept while the tests
    after it in its module are serial too: a run of them waits at most once for the other worker's
    serial run, and its processes' priorities are set twice, not once per test."""

    def __init__(self) -> None:
        self._stack = contextlib.ExitStack()
        self.held = False

    def take(self, lock: SerialLock) -> None:
        self._stack.enter_context(lock.hold(exclusive=True))
        self.held = True
        if PRIORITIES_RAISED:
            self._stack.callback(_set_priority, BASE_NICE)
            _set_priority(SERIAL_NICE)

    def release(self) -> None:
        self.held = False
        self._stack.close()


EXCLUSIVE = ExclusiveRun()


def _phase(item: pytest.Item, serial_phase: bool):  # noqa: ANN202
    """Under xdist, the lock for one phase of ``item``: exclusive from a serial test's call (what
    it times runs alone; see :class:`ExclusiveRun`), shared otherwise where priorities cannot be
    raised. A serial module's set-up (its workers started) and tear-down share the machine: nothing
    is timed there."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None or EXCLUSIVE.held:
        return contextlib.nullcontext()
    lock = SerialLock(Path(tempfile.gettempdir()) / f"epd-tests-{run}")
    if serial_phase and _serial(item):
        EXCLUSIVE.take(lock)  # released at a teardown (below)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if PRIORITIES_RAISED else lock.hold(exclusive=False)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    with _phase(item, serial_phase=False):
        yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    with _phase(item, serial_phase=True):
        yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if EXCLUSIVE.held and not (_serial(nextitem) and nextitem.module is item.module):
        EXCLUSIVE.release()
    with _phase(item, serial_phase=False):
        yield


def pytest_configure(config: pytest.Config) -> None:
    WATCHDOG.install()
    if os.environ["EPD_FORK_WORKERS"] == "1" and worker_zygote.SHARED_ZYGOTE not in os.environ:
        # One zygote for the run: xdist's workers and the scripts the tests run fork theirs from
        # this process's (their environment names its socket), not each from a zygote of its own.
        folder = tempfile.mkdtemp(prefix="epd-zygote-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        worker_zygote.share(folder)


@pytest.fixture(autouse=True)
def every_request_answered(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails a test in which a client request got no answer within its deadline (see
    request_watchdog.py), naming each such request."""
    WATCHDOG.begin_test(request.node.nodeid, request.node.get_closest_marker("unanswered_ok") is not None)
    yield
    unanswered = WATCHDOG.end_test(request.node.nodeid)
    assert not unanswered, "client requests got no answer within their deadline:\n" + "\n".join(unanswered)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Tests under a ``transports`` marker run once per transport it names."""
    marker = metafunc.definition.get_closest_marker("transports")
    if marker is not None and "connector_kind" in metafunc.fixturenames:
        unknown = set(marker.args) - set(CONNECTOR_KINDS)
        assert marker.args and not unknown, f"transports({marker.args}): each must be one of {CONNECTOR_KINDS}"
        metafunc.parametrize("connector_kind", marker.args)


# The order xdist's two workers take modules in (--dist loadfile --no-loadscope-reorder: each takes
# the next whole module when it is free), the rest after them in collection order. The suite is
# CPU-bound: the two longest CPU-heavy modules each run beside modules that mostly wait (connector
# tests over Mooncake, timeouts, serial fault tests: about 300 s of them beside each), then the
# other heavy ones pair up, longest first, and the in-process modules fill the end. Longest first
# whatever its kind ran the heavy modules two at a time on two cores for 14 minutes and the
# waiting ones two at a time at the end, the cores 58% busy.
MODULE_ORDER = (
    "test_benchmarks_smoke",  # beside:
    "test_control_plane", "test_transfer", "test_sleep_connector", "test_fork_wire",
    "test_hosts",  # beside:
    "test_faults", "test_sglang_encoder_units", "test_early_resume", "test_flow_control", "test_mooncake_partition",
    "test_load", "test_sleep_and_stop_under_load", "test_backpressure", "test_faults_under_load",
    "test_sglang_language", "test_sleep_workers", "test_workers", "test_sglang_encoder", "test_no_silent_hang",
    "test_sglang_plugin", "test_openai_api", "test_sglang_minimax", "test_sglang_audio", "test_sglang_two_request",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(MODULE_ORDER)}
    items.sort(key=lambda item: rank.get(item.module.__name__ if item.module else "", len(rank)))  # stable
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("connector_kind") == "memory":
            item.add_marker(pytest.mark.fast)


@pytest.fixture
def connector_kind() -> str:
    """Which transport the connector fixtures use: real Mooncake with a peer process; a test
    parametrized over ``transports`` gets the kind of its copy instead of this default."""
    return "mooncake"


@pytest.fixture(autouse=True)
def fast_tests_stay_in_process(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("fast") is None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a fast-tier test started a process: {args[1] if len(args) > 1 else kwargs}")

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


# The in-memory link runs at about what Mooncake's TCP reaches on loopback here, so what
# overlaps with a write over Mooncake overlaps with it in memory too.
MEMORY_LINK_BYTES_PER_S = 2e9


@pytest.fixture(scope="session")
def seeded_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., str]:
    """``seeded_checkpoint(hidden_size, layers=1)``: the seeded Qwen2.5-VL folder of that shape,
    written once per test session (once for all xdist workers, which share the parent of their
    temp folders). Tests only read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent

    def folder(hidden_size: int = 3584, layers: int = 1) -> str:
        path = root / f"seeded-{hidden_size}x{layers}"
        with open(root / f"{path.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # another worker may be writing it
            if not (path / "config.json").exists():
                partial = root / f"{path.name}.partial"
                shutil.rmtree(partial, ignore_errors=True)
                write_checkpoint(partial, hidden_size, layers=layers)
                partial.rename(path)
        return str(path)

    return folder


@pytest.fixture(scope="module")
def compiled_torch() -> Iterator[None]:
    """torch.compile on, as users run it, in the workers and scripts a module starts."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(COMPILE_OFF, "0")
        yield


def make_transport(kind: str, host: str = "127.0.0.1") -> MooncakeTransport | MemoryTransport:
    return MemoryTransport(host, MEMORY_LINK_BYTES_PER_S) if kind == "memory" else MooncakeTransport(host)


@dataclass
class Language:
    manager: EmbeddingReceiverManager
    allocator: BlockAllocator
    pool: BufferPool
    config: ConnectorConfig


def _peer_args(num_blocks: int, block_size: int, hidden_size: int, **extra: object) -> list[str]:
    args = ["--num-blocks", str(num_blocks), "--block-size", str(block_size), "--hidden-size", str(hidden_size)]
    for key, value in extra.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


class ManualClock:
    """A clock for the connector's timeouts that moves only when the test says: a 300-second
    timeout is crossed with ``advance(301)`` instead of a sleep. The managers' heartbeats run
    on it too, so while it stands still no peer is pinged or probed."""

    def __init__(self) -> None:
        self._now = time.monotonic()
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


# What connector_peer.py's flags default to, for a peer started in this process.
PEER_DEFAULTS = {"resume_timeout": 60.0, "bootstrap_timeout": 60.0}


@pytest.fixture
def make_peer(connector_kind: str) -> Iterator[Callable[..., EncodePeer | InProcessPeer]]:
    """Start encode peers; on teardown each live one must have every source block free."""
    peers: list[EncodePeer | InProcessPeer] = []

    def start(num_blocks: int = 320, block_size: int = 128, hidden_size: int = 3584,
              clock: ManualClock | None = None, **extra: object) -> EncodePeer | InProcessPeer:
        if connector_kind == "memory":
            peer = InProcessPeer(ConnectorConfig(num_blocks=num_blocks, block_size=block_size, hidden_size=hidden_size,
                                                 **{**PEER_DEFAULTS, **extra}),  # type: ignore[arg-type]
                                 MEMORY_LINK_BYTES_PER_S, clock or time.monotonic)
        else:
            assert clock is None, "a peer process keeps its own time: clock-driven tests are memory-only"
            peer = EncodePeer(*_peer_args(num_blocks, block_size, hidden_size, **extra))
        peers.append(peer)
        return peer

    yield start
    leaks = []
    for peer in peers:
        try:
            if peer.alive:
                stats = wait_peer_idle(peer)
                if stats["free_blocks"] != stats["num_blocks"]:
                    leaks.append(stats)
        finally:
            peer.close()
    assert not leaks, f"encode peer leaked blocks: {leaks}"


@pytest.fixture
def make_language(connector_kind: str) -> Iterator[Callable[..., Language]]:
    """Language-side managers; on teardown every block must be back in each pool."""
    made: list[tuple[Language, MooncakeTransport | MemoryTransport]] = []

    def start(clock: ManualClock | None = None, **overrides: object) -> Language:
        config = ConnectorConfig(**{"num_blocks": 256, **overrides})  # type: ignore[arg-type]
        pool = BufferPool(config.num_blocks, config.block_size, config.hidden_size, config.dtype)
        allocator = BlockAllocator(config.num_blocks)
        transport = make_transport(connector_kind, config.host)
        manager = EmbeddingReceiverManager(config, transport, pool, allocator, clock=clock or time.monotonic)
        lang = Language(manager, allocator, pool, config)
        made.append((lang, transport))
        return lang

    yield start
    try:
        for lang, _ in made:
            assert lang.manager.active_rooms() == 0, "rooms left open on the language side"
            assert lang.allocator.all_free(), f"language pool leaked: {lang.allocator.free_blocks}/{lang.allocator.num_blocks} free"
    finally:
        for lang, transport in made:
            lang.manager.close()
            transport.close()


def wait_peer_idle(peer: EncodePeer | InProcessPeer, timeout: float = 10.0) -> dict:
    """Peer stats once its rooms have all ended (frees can trail the last status by a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = peer.call("stats")
        if stats["free_blocks"] == stats["num_blocks"] or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


class RawLanguage:
    """A bare language side on the wire, standing in for a language worker in tests that speak
    raw ZMQ: ``pull`` gets the encoder's messages, ``push`` reaches the encoder. ``recv``
    answers pings as our language workers do (as ``session``) and returns the next other
    message."""

    def __init__(self, ctx: zmq.Context, session: str = "127.0.0.1:2") -> None:
        self.pull = ctx.socket(zmq.PULL)
        self.port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = ctx.socket(zmq.PUSH)
        self.session = session
        self.generation = 1  # of the pool it registers, and says in its pongs
        self.pings = 0
        self.joined: list[int] = []  # rooms the encoder said it has the encode request of

    def connect(self, rank_port: int) -> None:
        self.push.connect(f"tcp://127.0.0.1:{rank_port}")

    def send(self, msg) -> None:
        self.push.send_multipart(msg.encode())

    def register(self, pool: BufferPool, fork: bool = False) -> None:
        """Register ``pool`` under ``session``: with our extension frames, or as a fork peer does."""
        extra = () if fork else (self.generation, pool.num_blocks, pool.item_lens)
        self.send(RegisterMsg("127.0.0.1", self.port, self.session, pool.base_ptrs, *extra))

    def recv(self, timeout: float = 30.0) -> LanguageBound | None:
        """The next message that is not a ping (answered) or a room's "joined" status (noted in
        ``joined``), or None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while self.pull.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            msg = decode_language_bound(self.pull.recv_multipart())
            if self._joined(msg):
                continue
            if not isinstance(msg, PingMsg):
                return msg
            self.pings += 1
            self.push.send_multipart(PongMsg(self.session, msg.seq, self.generation).encode())
        return None

    def _joined(self, msg: LanguageBound) -> bool:
        joined = (isinstance(msg, StatusMsg) and msg.status == KVPoll.WaitingForInput and msg.sent_tokens == 0
                  and msg.total_tokens is None)
        if joined:
            self.joined.append(msg.room)
        return joined

    def answer_ping(self, timeout: float = 10.0) -> None:
        """Wait for the encoder's next ping and answer it (nothing else but a "joined" status may come first)."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.pull.poll(max(0, int((deadline - time.monotonic()) * 1000))), "no ping from the encoder"
            msg = decode_language_bound(self.pull.recv_multipart())
            if not self._joined(msg):
                break
        assert isinstance(msg, PingMsg), msg
        self.pings += 1
        self.push.send_multipart(PongMsg(self.session, msg.seq, self.generation).encode())

    def expect(self, timeout: float = 30.0, room: int | None = None) -> LanguageBound:
        """The next message (for ``room``, when given: others are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.recv(max(0.0, deadline - time.monotonic()))
            assert msg is not None, "no message from the encoder"
            if room is None or msg.room == room:
                return msg

    def close(self) -> None:
        self.pull.close(0)
        self.push.close(0)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A TCP port that accepts connections and never answers (a hung peer or media server)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    server.close()


@pytest.fixture
def raw_language() -> Iterator[RawLanguage]:
    ctx = zmq.Context()
    raw = RawLanguage(ctx)
    yield raw
    raw.close()
    ctx.term()


@pytest.fixture
def raw_pool(connector_kind: str):
    """A registered destination pool with its transfer engine, for tests that speak raw ZMQ."""
    transport = make_transport(connector_kind)
    pool = BufferPool(300, 128, 3584)
    transport.register([(b.ctypes.data, b.nbytes) for b in pool.buffers])
    yield transport, pool
    transport.unregister([b.ctypes.data for b in pool.buffers])
    transport.close()


@pytest.fixture(scope="module")
def model(folder):
    """transformers' Qwen2.5-VL on the module's ``folder`` checkpoint: the reference's model (a
    module on another family defines its own)."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    return Qwen2_5_VLForConditionalGeneration.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def reference(folder, model):
    """``greedy(paths)``: transformers' monolithic greedy ids for :func:`sglang_stack.prompt` with
    ``paths`` (``sglang_stack.image_reference``) on the module's ``folder``."""
    from sglang_stack import image_reference

    return image_reference(folder, model)
