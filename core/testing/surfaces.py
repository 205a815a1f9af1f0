"""The hostile-input checks every server surface runs against itself (see
``clusterwire.testing``): tokenless floods, huge and malformed fields from a token holder,
and control sequences in what reaches the operator's terminal."""

from __future__ import annotations

import math
import os
import re
import select
import subprocess
import sys
import threading
import time
import unicodedata
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message

from clusterwire import errors
from clusterwire.plugins import get_plugin_manager
from clusterwire.security import Security
from clusterwire.testing.floods import FLOODS, require_descriptors
from clusterwire.testing.load import process_usage
from clusterwire.transport import Channel, Frame, ListenOptions

_MiB = 1 << 20
#: Seconds each legitimate operation of a token holder may take, during a flood and after,
#: on an idle machine; on a busy one (``allowed_for``) LOAD_FACTOR times that, or LOAD_FACTOR
#: times the operation's slowest time just before the attack, if more (the attack is a
#: lock-out, which shows as errors and waits of many seconds; a busy machine's own slowness,
#: and the CPU the flood itself takes from a test's server, is not a lock-out).
OPERATION_SECONDS = 1.0
LOAD_FACTOR = 4.0
#: Seconds a hostile request may take to be answered (longer is a hang).
ANSWER_SECONDS = 5.0
#: How much a surface's resident memory may grow under a flood, unless its Surface says.
RSS_GROWTH_BYTES = 64 * _MiB
#: Connections a tokenless flood holds: past every default connection quota, gRPC's joint
#: one (``max_connections + max_pending_connections``) included.
FLOOD_CONNECTIONS = (ListenOptions().max_connections + ListenOptions().max_pending_connections
                     + 64)
#: The floods any TCP port takes (the others are gRPC health streams): a port that does not
#: speak gRPC runs these.
TCP_FLOODS = tuple(kind for kind in FLOODS if not kind.startswith("health"))
#: Streams of the ``health_names`` flood (each on its own connection, each naming an
#: invented service of ``hostile_peer.HEALTH_NAME_BYTES``).
HEALTH_NAME_STREAMS = 24
#: Seconds anything the kit waits for (a flood starting, a hung operation) may take
#: before the check fails.
_GIVE_UP_S = 60.0

#: Strings a token holder or a hostile server plants wherever a string can go.
HOSTILE_STRINGS: tuple[str, ...] = (
    "\x1b]0;pwned\x07",                                  # OSC 0: sets the window title
    "\x1b[2J\x1b[Hpwned",                                # CSI 2J: clears the screen
    "\x1b]8;;https://example.invalid/\x1b\\click\x1b]8;;\x1b\\",  # OSC 8: a hyperlink
    "\x9b2Jpwned",                                       # C1 CSI
    "user\u202etxt.exe",                                 # bidi override
    "nul\x00byte",
    "del\x7fete",
    "[/pwned]",                                          # rich markup: a closing tag
    "[bold red]x",                                       # rich markup: a style
    "x" * _MiB,
)
_HOSTILE_IDS = ("osc0-title", "csi-clear", "osc8-link", "c1-csi", "bidi-override", "nul",
                "del", "markup-close", "markup-style", "1mib")
#: Bidirectional-text controls: they reorder what a terminal shows.
_BIDI = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")

#: The errors that blame the request, the right answers to a malformed one.
_REFUSALS = (errors.CancelledError,  # e.g. a stream superseded by the same consumer's
             errors.InvalidArgumentError, errors.ResourceExhaustedError, errors.NotFoundError,
             errors.PermissionDeniedError, errors.FailedPreconditionError,
             errors.OutOfRangeError, errors.UnimplementedError, errors.AlreadyExistsError)
_TRACEBACK = "Traceback (most recent call last)"


def assert_terminal_safe(output: str, allow_cr: bool = False) -> None:
    """Fail naming the first raw control character in ``output`` (C0 but newline and tab,
    and CR if ``allow_cr``; DEL; C1; bidi controls): what a terminal would act on."""
    allowed = "\n\t\r" if allow_cr else "\n\t"
    for index, char in enumerate(output):
        if (unicodedata.category(char) == "Cc" and char not in allowed) or char in _BIDI:
            context = output[max(0, index - 40):index + 40]
            raise AssertionError(f"raw control character {char!r} at {index} of "
                                 f"{len(output)} characters: ...{context!r}...")


@dataclass(frozen=True)
class Surface:
    """A running server surface the kit attacks."""

    #: What it is, for messages ("task server", "dispatcher", ...).
    name: str
    #: host:port of the port under attack.
    address: str
    #: The server's process (its memory is read from /proc and it must stay alive); not
    #: the test's own.
    pid: int
    #: A token holder's legitimate operations by name: each must succeed within
    #: OPERATION_SECONDS (see ``allowed_seconds``) during and after every attack. Each call
    #: must do its work anew (a fresh connection, a new job...), not reuse what an earlier one made.
    operations: Mapping[str, Callable[[], object]]
    #: The cluster token the server checks.
    token: bytes
    #: The transport that carries ``requests`` (a clusterwire protocol name).
    protocol: str = "grpc"
    #: Well-formed request headers (protobuf messages) a token holder sends; the kit sends
    #: each without the token and malformed variants of each with it. Leave out requests
    #: that wait by design (a barrier); give those that change who serves (membership) a
    #: surface and a server of their own.
    requests: Sequence[Message] = ()
    #: The protobuf type of the replies' headers (it has a ``status`` field).
    response_type: type[Message] | None = None
    #: Plants a string in the surface (as a token holder or a hostile server would) and
    #: returns what the operator's terminal would get from the tool that shows it: the
    #: string must reach that output.
    show: Callable[[str], str] | None = None
    #: The server's stderr so far (no traceback may appear in it).
    log: Callable[[], str] | None = None
    #: How much the server's resident memory may grow under a flood.
    max_rss_growth_bytes: int = RSS_GROWTH_BYTES


def _bounded(call: Callable[[], object], limit: float, what: str
             ) -> tuple[float, BaseException | None]:
    """(seconds, error or None) of ``call`` run on a thread; fail naming ``what`` if it runs
    past ``limit``."""
    outcome: list[tuple[float, BaseException | None]] = []

    def run() -> None:
        started = time.monotonic()
        try:
            call()
            outcome.append((time.monotonic() - started, None))
        except BaseException as err:  # reported by the caller
            outcome.append((time.monotonic() - started, err))

    thread = threading.Thread(target=run, daemon=True, name="surface-kit")
    thread.start()
    thread.join(limit)
    assert outcome, f"{what} did not return within {limit} s"
    return outcome[0]


def check_operations(surface: Surface, during: str,
                     allowed: float = OPERATION_SECONDS) -> dict[str, float]:
    """Run every legitimate operation once; each must succeed within ``allowed`` seconds.
    Returns their seconds by name."""
    seconds = {}
    for name, operation in surface.operations.items():
        took, error = _bounded(operation, _GIVE_UP_S,
                               f"{surface.name}: a token holder's {name} {during}")
        assert error is None, (
            f"{surface.name}: a token holder's {name} failed {during}: "
            f"{type(error).__name__}: {error}")
        assert took < allowed, (
            f"{surface.name}: a token holder's {name} took {took:.3f} s {during} "
            f"(allowed: {allowed:.3f} s)")
        seconds[name] = took
    return seconds


def allowed_for(slowest_before: float) -> float:
    """How long a legitimate operation that took at most ``slowest_before`` seconds just
    before an attack may take under it: OPERATION_SECONDS, or LOAD_FACTOR times that on a
    machine whose load exceeds its CPUs, or LOAD_FACTOR times ``slowest_before``, whichever
    is more."""
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    return max(OPERATION_SECONDS * (LOAD_FACTOR if busy else 1.0),
               LOAD_FACTOR * slowest_before)


def allowed_seconds(surface: Surface, rounds: int = 3) -> float:
    """``allowed_for`` the slowest of ``rounds`` rounds of ``surface``'s operations now."""
    return allowed_for(max(
        max(check_operations(surface, "before the attack", _GIVE_UP_S).values())
        for _ in range(rounds)))


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(line.split()[1] for line in status if line.startswith("State:"))


def assert_alive(surface: Surface) -> None:
    """The surface's server process still runs."""
    try:
        state = _state(surface.pid)
    except FileNotFoundError:
        state = "gone"
    assert state not in ("Z", "X", "gone"), f"{surface.name}: its process died ({state})"


class _MemoryWatch:
    """The highest resident memory of a process, sampled on a thread until ``stop``."""

    def __init__(self, pid: int):
        self.pid = pid
        self.start = self.peak = process_usage(pid)[0]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="surface-rss")
        self._thread.start()

    def _sample(self) -> None:
        while True:
            try:
                self.peak = max(self.peak, process_usage(self.pid)[0])
            except (FileNotFoundError, KeyError):  # gone, or a zombie (no VmRSS)
                return
            if self._stop.wait(0.05):
                return

    def stop(self) -> int:
        """Stop sampling; the growth over the start, in bytes."""
        self._stop.set()
        self._thread.join(5)
        return self.peak - self.start


class HostilePeer:
    """A ``clusterwire.testing.hostile_peer`` process: runs one flood at a time."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "clusterwire.testing.hostile_peer"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._kind = ""

    def _send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def _answer(self, expected: str) -> int:
        ready, _, _ = select.select([self.proc.stdout], [], [], _GIVE_UP_S)
        assert ready, f"the {self._kind} flood said nothing within {_GIVE_UP_S} s"
        words = self.proc.stdout.readline().split()
        assert words[:1] == [expected], f"the {self._kind} flood said {' '.join(words)!r}"
        return int(words[1])

    def flood(self, kind: str, address: str, count: int) -> int:
        """Start ``kind`` of flood (``floods.FLOODS``) of ``count`` connections or streams
        to ``address``; how many it holds once up."""
        self._kind = kind
        self._send(f"{kind} {address} {count}")
        try:
            return self._answer("READY")
        except BaseException:
            self._send("")  # the peer waits for the end of the flood
            raise

    def stop(self) -> int:
        """End the flood; the connections it opened in all."""
        self._send("")
        return self._answer("DONE")

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.proc.stdout.close()


# -- malformed fields --------------------------------------------------------------------

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SINT32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(1 << 31), (1 << 31) - 1),
    FieldDescriptor.TYPE_INT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SINT64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_SFIXED64: (-(1 << 63), (1 << 63) - 1),
    FieldDescriptor.TYPE_UINT32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_FIXED32: (0, (1 << 32) - 1),
    FieldDescriptor.TYPE_UINT64: (0, (1 << 64) - 1),
    FieldDescriptor.TYPE_FIXED64: (0, (1 << 64) - 1),
}
_REPEATED_ITEMS = 1 << 16
_MAX_DEPTH = 4


def _extremes(descriptor: FieldDescriptor) -> list[tuple[str, object]]:
    """(label, value) of hostile values for one scalar field."""
    kind = descriptor.type
    if kind in _INT_RANGES:
        low, high = _INT_RANGES[kind]
        values = {-1, low, high} if low else {high, min(high, 1 << 63)}
        return [(str(v), v) for v in sorted(values)]
    if kind in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        big = 1e308 if kind == FieldDescriptor.TYPE_DOUBLE else 3e38
        return [(str(v), v) for v in (math.nan, math.inf, -math.inf, -1.0, big)]
    if kind == FieldDescriptor.TYPE_STRING:
        return [("1 MiB", "x" * _MiB), ("control characters", "\x1b]0;pwned\x07\x00\x9b")]
    if kind == FieldDescriptor.TYPE_BYTES:
        return [("1 MiB", b"\xff" * _MiB)]
    if kind == FieldDescriptor.TYPE_ENUM:
        return [("an unknown value", (1 << 31) - 1)]
    return []  # bool: every value is a valid one


def _is_map(descriptor: FieldDescriptor) -> bool:
    return descriptor.message_type is not None and \
        descriptor.message_type.GetOptions().map_entry


def _fields(message: Message, depth: int = 0
            ) -> Iterator[tuple[tuple[str | int, ...], FieldDescriptor]]:
    """(path, descriptor) of every scalar field and every map of scalars of ``message``,
    descending into the submessages it sets (a repeated one's first item) down to
    _MAX_DEPTH."""
    for descriptor in message.DESCRIPTOR.fields:
        if _is_map(descriptor):
            if descriptor.message_type.fields_by_name["value"].message_type is None:
                yield (descriptor.name,), descriptor
            continue
        if descriptor.message_type is None:
            yield (descriptor.name,), descriptor
            continue
        if depth >= _MAX_DEPTH:
            continue
        value = getattr(message, descriptor.name)
        if descriptor.is_repeated:
            if not len(value):
                continue
            value = value[0]
            prefix: tuple[str | int, ...] = (descriptor.name, 0)
        elif message.HasField(descriptor.name):
            prefix = (descriptor.name,)
        else:
            continue
        for path, inner in _fields(value, depth + 1):
            yield (*prefix, *path), inner


def _edit(message: Message, path: tuple[str | int, ...],
          change: Callable[[Message, str], None]) -> Message:
    """A copy of ``message`` with ``change(holder, name)`` done to the field at ``path``."""
    copy = type(message)()
    copy.CopyFrom(message)
    holder = copy
    for step in path[:-1]:
        holder = holder[step] if isinstance(step, int) else getattr(holder, step)
    change(holder, str(path[-1]))
    return copy


def _changes(descriptor: FieldDescriptor
             ) -> Iterator[tuple[str, Callable[[Message, str], None]]]:
    """(label, change) of the hostile values of one field (see ``malformed_variants``)."""
    if _is_map(descriptor):
        key, value = (descriptor.message_type.fields_by_name[n] for n in ("key", "value"))
        for label, extreme in _extremes(value):
            yield (f"[a key]={label}",
                   lambda h, n, v=extreme: getattr(h, n).__setitem__(_a_key(h, n, key), v))
        for label, extreme in _extremes(key):
            yield (f"[{label}]", lambda h, n, k=extreme: getattr(h, n).__setitem__(
                k, next(iter(getattr(h, n).values()), value.default_value)))
        return
    for label, extreme in _extremes(descriptor):
        if descriptor.is_repeated:
            if isinstance(extreme, str | bytes):
                extreme = extreme[:16]
                label = repr(extreme)
            yield (f"{_REPEATED_ITEMS} x {label}",
                   lambda h, n, v=extreme: getattr(h, n).extend([v] * _REPEATED_ITEMS))
        else:
            yield label, lambda h, n, v=extreme: setattr(h, n, v)


def _a_key(holder: Message, name: str, key: FieldDescriptor) -> object:
    """A key the map at ``name`` has (its first), or the key type's default."""
    return next(iter(getattr(holder, name)), key.default_value)


def _wire_tag(number: int, wire_type: int) -> bytes:
    tag, out = number << 3 | wire_type, bytearray()
    while tag > 0x7F:
        out.append(tag & 0x7F | 0x80)
        tag >>= 7
    return bytes([*out, tag])


def malformed_variants(request: Message) -> Iterator[tuple[str, bytes]]:
    """(what, serialized header) of hostile variants of well-formed ``request``: every scalar
    field at its extremes (1 MiB and control characters in strings, negative and 2^63 / 2^64-1
    numbers, NaN and infinities, unknown enum values, 65,536 items in repeated ones), every
    map of scalars with an extreme value and an extreme key, every top-level field with the
    wrong wire type, and a string that is not UTF-8."""
    for path, descriptor in _fields(request):
        where = ".".join(str(step) for step in path)
        for label, change in _changes(descriptor):
            try:
                variant = _edit(request, path, change)
            except (ValueError, TypeError):  # a value protobuf itself refuses to set
                continue
            yield (f"{where}{label}" if label.startswith("[") else f"{where}={label}",
                   variant.SerializeToString())
    well_formed = request.SerializeToString()
    for descriptor in request.DESCRIPTOR.fields:
        length_delimited = (descriptor.message_type is not None or descriptor.type in (
            FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES))
        wrong = (_wire_tag(descriptor.number, 0) + b"\x7f" if length_delimited
                 else _wire_tag(descriptor.number, 2) + b"\x03abc")
        yield f"{descriptor.name} as the wrong wire type", well_formed + wrong
        if descriptor.type == FieldDescriptor.TYPE_STRING:
            yield (f"{descriptor.name} not UTF-8",
                   well_formed + _wire_tag(descriptor.number, 2) + b"\x02\xff\xfe")


def _answer(channel: Channel, surface: Surface, header: bytes) -> BaseException | None:
    """The clusterwire error the surface answered ``header`` with (None: OK); a reply that
    is not a clusterwire reply, or that carries a server traceback, is an AssertionError."""
    try:
        reply = channel.call(Frame(header, []), timeout=ANSWER_SECONDS)
    except errors.OpError as err:
        return err
    try:
        status = surface.response_type.FromString(bytes(reply.header)).status
    except DecodeError as err:
        return AssertionError(f"the reply's header is not a {surface.response_type.__name__}:"
                              f" {err}")
    if _TRACEBACK in status.message or status.remote_traceback:
        return AssertionError(f"the reply carries a server traceback: {status.message[:400]}")
    if status.code == errors.OK:
        return None
    return errors.error_from_code(status.code, status.message)


def _connect(surface: Surface, token: bytes | None) -> Channel:
    return get_plugin_manager().transport(surface.protocol).connect(
        surface.address, Security(token=token))


class SurfaceSuite:
    """Subclass as ``TestXxx`` with a ``surface`` fixture (any scope) yielding a Surface.

    The class says which checks apply (``floods``, ``takes_requests``, ``prints_strings``);
    those that do not are not collected, so a skip always means something. A check that
    applies but lacks what its Surface should give fails, naming the attribute."""

    #: Seconds each flood is held while the legitimate operations run again and again.
    flood_seconds: float = 1.0
    #: The floods to run (``floods.FLOODS``; ``TCP_FLOODS`` for a port that does not speak
    #: gRPC); a surface on a port another class floods already may run none.
    floods: tuple[str, ...] = FLOODS
    #: The surface takes clusterwire requests (its Surface gives ``requests``): the token
    #: and malformed-field checks run.
    takes_requests: bool = True
    #: The surface prints strings from the network (its Surface gives ``show``): the
    #: terminal check runs for each of HOSTILE_STRINGS.
    prints_strings: bool = True
    #: Checks failing for a known reason: test id (``test_tokenless_flood[health_watch]``)
    #: to the reason. They run as ``xfail(strict=False)``.
    known_failures: Mapping[str, str] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        unknown = set(cls.floods) - set(FLOODS)
        if unknown:
            raise ValueError(f"{cls.__name__}.floods: unknown {sorted(unknown)}; the floods "
                             f"are {FLOODS}")
        # pytest collects only callables: a check set to None here is not a test at all.
        for check, applies in (
                ("test_tokenless_flood", bool(cls.floods)),
                ("test_requests_without_the_token_are_refused", cls.takes_requests),
                ("test_huge_and_malformed_fields", cls.takes_requests),
                ("test_printed_strings_are_terminal_safe", cls.prints_strings)):
            if not applies:
                setattr(cls, check, None)

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        """The flood check runs once per flood of ``floods``."""
        if metafunc.definition.originalname == "test_tokenless_flood":
            metafunc.parametrize("kind", self.floods)

    @pytest.fixture
    def surface(self) -> Surface:
        raise NotImplementedError("a SurfaceSuite subclass gives a `surface` fixture")

    @pytest.fixture(scope="class")
    @classmethod
    def hostile_peer(cls) -> Iterator[HostilePeer]:
        require_descriptors(FLOOD_CONNECTIONS + 4096)  # the peer inherits the limit
        peer = HostilePeer()
        yield peer
        peer.close()

    @pytest.fixture(autouse=True)
    def _known_failure(self, request) -> None:
        reason = self.known_failures.get(request.node.name)
        if reason is not None:
            request.node.add_marker(pytest.mark.xfail(strict=False, reason=reason))

    @pytest.fixture
    def _server_log(self, surface) -> Iterator[None]:
        """Fail the check if the server wrote a traceback meanwhile."""
        before = len(surface.log()) if surface.log else 0
        yield
        if surface.log:
            written = surface.log()[before:]
            assert _TRACEBACK not in written, (
                f"{surface.name} logged a traceback: {written[written.index(_TRACEBACK):][:2000]}")

    # -- floods without the token ------------------------------------------------------

    @pytest.mark.usefixtures("_server_log")
    def test_tokenless_flood(self, surface: Surface, kind: str, request) -> None:
        """``kind`` of flood (``floods.FLOODS``) of FLOOD_CONNECTIONS connections, held
        ``flood_seconds``: every legitimate operation succeeds within OPERATION_SECONDS
        (``allowed_seconds``) throughout, the server's memory grows by less than
        ``max_rss_growth_bytes``, and it still serves after."""
        count = HEALTH_NAME_STREAMS if kind == "health_names" else FLOOD_CONNECTIONS
        hostile_peer: HostilePeer = request.getfixturevalue("hostile_peer")
        allowed = allowed_seconds(surface)
        memory = _MemoryWatch(surface.pid)
        try:
            held = hostile_peer.flood(kind, surface.address, count)
            try:
                rounds, slowest = 0, 0.0
                deadline = time.monotonic() + self.flood_seconds
                while rounds < 2 or time.monotonic() < deadline:
                    took = check_operations(
                        surface, f"under a {kind} flood of {held} tokenless connections",
                        allowed)
                    slowest = max(slowest, *took.values())
                    rounds += 1
                assert_alive(surface)
            finally:
                connects = hostile_peer.stop()
        finally:
            growth = memory.stop()
        print(f"{surface.name}, {kind} flood: {held} held, {connects} opened, "
              f"{rounds} rounds of operations, slowest {slowest:.3f} s, "
              f"RSS +{growth / _MiB:.1f} MiB")
        assert growth < surface.max_rss_growth_bytes, (
            f"{surface.name} grew by {growth / _MiB:.1f} MiB under a {kind} flood "
            f"(allowed: {surface.max_rss_growth_bytes / _MiB:.0f} MiB)")
        check_operations(surface, f"after a {kind} flood", allowed)

    # -- requests ----------------------------------------------------------------------

    def _requests(self, surface: Surface) -> Sequence[Message]:
        assert surface.requests, (
            f"{surface.name}'s Surface gives no requests: give them, or set "
            f"{type(self).__name__}.takes_requests = False")
        return surface.requests

    @pytest.mark.usefixtures("_server_log")
    def test_requests_without_the_token_are_refused(self, surface: Surface) -> None:
        """Every request without a token and with a wrong one: UnauthenticatedError."""
        requests = self._requests(surface)
        for token in (None, os.urandom(32)):
            channel = _connect(surface, token)
            try:
                for request in requests:
                    answer = _answer(channel, surface, request.SerializeToString())
                    assert isinstance(answer, errors.UnauthenticatedError), (
                        f"{surface.name} answered {str(request)[:200]!r} with "
                        f"{'no' if token is None else 'a wrong'} token: {answer!r}")
            finally:
                channel.close()

    @pytest.mark.usefixtures("_server_log")
    def test_huge_and_malformed_fields(self, surface: Surface) -> None:
        """Every ``malformed_variants`` of every request, from a token holder: answered within
        ANSWER_SECONDS, OK or an error that blames the request (never InternalError,
        UnknownError, a deadline or a traceback); the server stays up and serves after."""
        requests = self._requests(surface)
        allowed = allowed_seconds(surface)
        failures, sent = [], 0
        channel = _connect(surface, surface.token)
        try:
            for request in requests:
                for what, header in malformed_variants(request):
                    sent += 1
                    answer = _answer(channel, surface, header)
                    if answer is not None and not isinstance(answer, _REFUSALS):
                        failures.append(f"{type(request).__name__} with {what}: "
                                        f"{type(answer).__name__}: {str(answer)[:300]}")
        finally:
            channel.close()
        print(f"{surface.name}: {sent} malformed variants sent")
        assert not failures, f"{len(failures)} of {sent}:\n" + "\n".join(failures[:20])
        assert_alive(surface)
        check_operations(surface, "after malformed requests", allowed)

    # -- the operator's terminal -------------------------------------------------------

    @pytest.mark.parametrize("text", HOSTILE_STRINGS, ids=_HOSTILE_IDS)
    def test_printed_strings_are_terminal_safe(self, surface: Surface, text: str) -> None:
        """``show`` plants ``text`` and returns what the terminal gets: no raw control
        character reaches it, and markup is shown as text, not interpreted."""
        assert surface.show is not None, (
            f"{surface.name}'s Surface gives no show: give it, or set "
            f"{type(self).__name__}.prints_strings = False")
        output: list[str] = []
        _, error = _bounded(lambda: output.append(surface.show(text)), _GIVE_UP_S,
                            f"{surface.name}: showing {text[:40]!r}")
        assert error is None, f"{surface.name} failed to show {text[:40]!r}: {error!r}"
        assert_terminal_safe(output[0])
        if len(text) < 100:  # it reached the output (escaped or not)
            words = re.findall(r"[a-z]{3,}", text)
            assert any(word in output[0] for word in words), (
                f"{text!r} did not reach the output:\n{output[0][:2000]}")
        if text.isprintable() and len(text) < 100:
            assert text in output[0], f"{text!r} is not shown as it is:\n{output[0][:2000]}"
