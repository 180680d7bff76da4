"""Hung ranks under ft_launcher (--enable-ft-package): each rank tells NVRx's rank monitor which phase it is
in (sections `setup`: process start to the first iteration, checkpoint load included; `step`: one
training iteration; `checkpointing`: one save), and the monitor kills a rank that stays in a phase past
its timeout, so ft_launcher restarts the worker group and the loader resumes from the newest checkpoint.

NVRx 0.4.1 traps handled here: sections are not heartbeats (its default heartbeat timeouts would kill a
sections-only run after an hour), a section without a configured timeout leaves the rank unmonitored,
and calculated timeouts persisted by a fast run can kill a slower next run (they are floored).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import stat
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from megatron_resil import events, exit_codes, parallel
from megatron_resil.checkpointing.atomic import atomic_write_text
from megatron_resil.progress import TrainProgress

SECTIONS = ("setup", "step", "checkpointing")
STATE_FILE = "ft_state.json"
_EXAMPLE_TIMEOUTS = "setup:600,step:180,checkpointing:420"
_PHASE = {"setup": "set-up", "step": "training iterations", "checkpointing": "saves"}
_TIMEOUTS_KEY = "current_timeouts"  # RankMonitorClient.state_dict()'s one key
# Heartbeats only bound the gaps between phases (see _describe); more than one a second buys nothing and
# each costs an IPC round trip to the monitor.
_HEARTBEAT_MIN_INTERVAL_SECS = 1.0
_setup_said = False  # this process logged the monitoring decisions (once, whatever the attempts)
_restart_said = False  # this process said which worker group restart it is in (once: its in-process
# restarts run set-up again in the same process, of the same worker group)


def report_restart() -> None:
    """After an in-job restart (ft_launcher or torchrun --max-restarts), say which one this is, so a
    restart loop is visible in the log and in events.jsonl (the run timeline reads `restart` events)."""
    global _restart_said
    count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if count <= 0 or _restart_said:
        return
    _restart_said = True
    limit = os.environ.get("TORCHELASTIC_MAX_RESTARTS")
    bound = f"of at most {limit}" if limit else "(the launcher's maximum is unknown)"
    events.decision("restart", f"worker group restart {count} {bound} (the launcher restarted every rank "
                    "after a failure); resuming from the newest checkpoint", count=count,
                    max_restarts=int(limit) if limit and limit.isdigit() else None)


@dataclass(frozen=True)
class FtConfig:
    calc_timeouts: bool
    warmup_iters: int
    floor_secs: float
    state_path: str | None  # <save>/ft_state.json: calculated timeouts, from one run to the next
    save_intervals: tuple[int, ...]  # iterations at which maybe_save may write
    async_save: bool  # maybe_save may publish a pending save at any iteration

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FtConfig:
        return cls(calc_timeouts=args.calc_ft_timeouts, warmup_iters=args.ft_num_warmup_iters,
                   floor_secs=args.ft_timeouts_floor_secs,
                   state_path=os.path.join(args.save, STATE_FILE) if args.save else None,
                   save_intervals=tuple(i for i in (args.save_interval, args.non_persistent_save_interval)
                                        if i),
                   async_save=args.async_save)


class FaultTolerance:
    """Without --enable-ft-package: every hook does nothing, and NVRx is never imported."""

    @staticmethod
    def from_args(args: argparse.Namespace) -> FaultTolerance:
        """Call first thing: with --enable-ft-package this connects to the rank monitor and opens `setup`."""
        if not args.enable_ft_package:
            return FaultTolerance()
        return MonitoredRank(FtConfig.from_args(args))

    def log_setup(self) -> None:
        """Log the monitoring decisions (once events and torch.distributed are up, so rank 0 logs them)."""

    def setup_done(self, resumed: bool) -> None:
        """Set-up is over (checkpoint loaded, data ready); `resumed`: a checkpoint was loaded."""

    def step(self) -> contextlib.AbstractContextManager:
        """Around one training iteration."""
        return contextlib.nullcontext()

    def checkpointing(self, save: Callable[[TrainProgress], bool], progress: TrainProgress,
                      final: bool = False) -> bool:
        """`save(progress)` (returns True if it saved), timed as a save; `final`: the end-of-run save."""
        return save(progress)

    def close(self) -> None:
        """End of training (all ranks): last timeout update, then disconnect from the monitor."""

    def job_ending(self, exit_code: int) -> None:
        """This rank is about to exit with `exit_code` (after close, or from set-up)."""


class MonitoredRank(FaultTolerance):
    """With --enable-ft-package: this rank's phases reported to its rank monitor."""

    def __init__(self, config: FtConfig) -> None:
        with warnings.catch_warnings():  # NVRx's pynvml deprecation warning is noise on every rank
            warnings.simplefilter("ignore")
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient
            from nvidia_resiliency_ext.fault_tolerance.rank_monitor_client import RankMonitorClientError
        self.config = config
        foreign = foreign_ipc_socket()
        if foreign:  # connecting would send to, and unpickle the answer of, whoever holds that name
            sys.stderr.write(f"pretrain.py: error: --enable-ft-package: {foreign}; nothing was sent to it. "
                             "Launch with `python -m megatron_resil.launch.ft_launcher` (its sockets in a "
                             "directory of its own), or set TMPDIR to a directory only you can write\n")
            sys.exit(exit_codes.BAD_ARGUMENTS)
        self.client = RankMonitorClient()
        try:
            self.client.init_workload_monitoring()
        except (OSError, RuntimeError, RankMonitorClientError) as err:  # a launch problem, not a bug
            sys.stderr.write(f"pretrain.py: error: --enable-ft-package: cannot reach ft_launcher's rank "
                             f"monitor ({type(err).__name__}: {err}); launch with ft_launcher, or drop "
                             "--enable-ft-package\n")
            sys.exit(exit_codes.BAD_ARGUMENTS)
        self._decisions: list[str] = []
        self.sections = self._usable_sections()
        self._load_state()
        self._section_open("setup")
        self._resumed = False
        self._steps = 0  # iterations run by this process
        self._timed_steps = 0  # of them, inside the step section
        self._saves = 0  # saves timed by the checkpointing section
        self._last_heartbeat = 0.0

    # ---- what the launcher configured ---------------------------------------------------------
    def _usable_sections(self) -> frozenset[str]:
        """Our sections that have a timeout in ft_launcher's config. Opening one that is not in it
        raises in the client after the monitor has recorded it, and the monitor's checking task then
        dies on the unknown name: the rank would go unmonitored. One without a timeout (null) monitors
        nothing. Either way we do not open it; the phase falls to heartbeats."""
        configured = self.client.cfg.rank_section_timeouts
        usable = frozenset(s for s in SECTIONS if configured.get(s) is not None)
        for section in SECTIONS:
            if section in usable:
                continue
            why = "has no entry" if section not in configured else "has a null timeout"
            self._decisions.append(
                f"section '{section}' {why} in ft_launcher's config, so it is not opened; "
                f"{_PHASE[section]} fall back to {self._fallback_cover(section)}. To time them, configure "
                f"it: ft_launcher --ft-rank-section-timeouts {_EXAMPLE_TIMEOUTS} (or rank_section_timeouts "
                "in the --ft-cfg-path YAML)")
        return usable

    def _fallback_cover(self, section: str) -> str:
        hb = self.client.hb_timeouts
        heartbeat = hb.initial if section == "setup" else hb.subsequent
        oos = self.client.cfg.rank_out_of_section_timeout
        covers = [f"the heartbeat timeout ({heartbeat:g} s)"] if heartbeat is not None else []
        if oos is not None:
            covers.append(f"the out-of-section timeout ({oos:g} s)")
        return " and ".join(covers) if covers else "NOTHING: this rank is UNMONITORED while in them"

    # ---- calculated timeouts: floored, persisted, loaded ---------------------------------------
    def _load_state(self) -> None:
        path = self.config.state_path
        if path is None or not os.path.exists(path):
            return
        try:
            with open(path) as f:
                saved = json.load(f)
            state, notes = merge_saved_timeouts(saved, self.client.cfg, self.sections, self.config.floor_secs)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
            self._decisions.append(f"ignoring {path} ({type(err).__name__}: {err}); using the configured "
                                   "timeouts")
            return
        if state is None:
            return
        self.client.load_state_dict(state)  # initialised already: the monitor is updated now
        self._decisions.append(f"loaded calculated timeouts from {path}: {notes}")

    def _update_timeouts(self, closing: bool = False) -> None:
        """Calculate timeouts from what this run observed (a collective: every rank calls it at the
        same point), floor them, use them now and keep them for the next run. Like Megatron: `setup`
        only after a resume (a fresh start's set-up is shorter), `step` after enough timed iterations,
        `checkpointing` after a synchronous save, out-of-section only at the end of a complete run."""
        selected = []
        if "setup" in self.sections and self._resumed:
            selected.append("setup")
        if "step" in self.sections and self._timed_steps >= max(1, self.config.warmup_iters):
            selected.append("step")
        if "checkpointing" in self.sections and self._saves and not self.config.async_save:
            selected.append("checkpointing")
        out_of_section = closing and {"setup", "step"} <= set(selected) and self._saves > 0
        if not selected and not out_of_section:
            return
        # (Never an empty selection: NVRx's readiness check reads [] as "all sections".)
        if not self.client.calculate_and_set_section_timeouts(
                selected_sections=selected, calc_out_of_section=out_of_section, skip_if_not_ready=True):
            return
        state, raised = floor_timeouts(self.client.state_dict(), self.config.floor_secs)
        if raised:
            self.client.load_state_dict(state)  # the floored values replace the raw ones at the monitor
        where = ""
        if self.config.state_path is not None:
            if parallel.is_rank0():
                atomic_write_text(self.config.state_path, json.dumps(state, indent=1, sort_keys=True) + "\n")
            where = f"; kept in {self.config.state_path}"
        floor_note = f" (raised to the floor --ft-timeouts-floor-secs {self.config.floor_secs:g}: " \
                     f"{', '.join(raised)})" if raised else ""
        now = _describe_sections(self.client.section_timeouts, self.sections)
        events.decision("ft", f"timeouts calculated after {self._steps} iterations of this run: "
                        f"{now}{floor_note}{where}",
                        calculated=selected + (["out_of_section"] if out_of_section else []))

    # ---- the hooks -------------------------------------------------------------------------------
    def log_setup(self) -> None:
        global _setup_said
        decisions, self._decisions = self._decisions, []
        if _setup_said:  # an in-process restart's next attempt: the same monitor, said once per process
            return
        _setup_said = True
        for message in decisions:
            events.decision("ft", message)
        events.decision("ft", self._describe())
        if self.client.cfg.enable_nic_monitor:
            events.decision("ft", "ft_launcher's NIC monitor is on: its command-line default (true) "
                            "overrides enable_nic_monitor: false in a YAML; pass --ft-enable-nic-monitor "
                            "false unless you want InfiniBand link checks")

    def _describe(self) -> str:
        hb = self.client.hb_timeouts
        text = (f"hang detection on: {_describe_sections(self.client.section_timeouts, self.sections)}; "
                f"the first {self.config.warmup_iters} iterations are not timed as steps; a heartbeat "
                f"after set-up, each save and iterations (at most one per {_HEARTBEAT_MIN_INTERVAL_SECS:g} "
                f"s) keeps the heartbeat timeouts (initial {_secs(hb.initial)}, subsequent "
                f"{_secs(hb.subsequent)}) an outer bound, since NVRx does not count sections as heartbeats")
        # Heartbeats are sent between phases only, so a heartbeat timeout shorter than a section's
        # timeout kills a healthy phase that runs longer than it.
        shorter = [f"{s} ({self.client.section_timeouts.section[s]:g} s)" for s in sorted(self.sections)
                   if (limit := hb.initial if s == "setup" else hb.subsequent) is not None
                   and self.client.section_timeouts.section[s] > limit]
        if shorter:
            text += (f"; WARNING: the heartbeat timeout is shorter than {', '.join(shorter)} and ends such "
                     "a phase first: raise --ft-initial-rank-heartbeat-timeout/--ft-rank-heartbeat-timeout "
                     "or set them null in the --ft-cfg-path YAML")
        return text

    def _section_open(self, section: str) -> bool:
        if section not in self.sections:
            return False
        self.client.start_section(section)
        return True

    def _heartbeat(self, now: float | None = None) -> None:
        self.client.send_heartbeat()
        self._last_heartbeat = time.monotonic() if now is None else now

    def setup_done(self, resumed: bool) -> None:
        if "setup" in self.sections:
            self.client.end_section("setup")
        self._resumed = resumed
        self._heartbeat()  # the first one: ends the initial heartbeat timeout's watch over set-up

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        timed = self._steps >= self.config.warmup_iters and self._section_open("step")
        yield
        if timed:
            self.client.end_section("step")
            self._timed_steps += 1
        self._steps += 1
        now = time.monotonic()
        if now - self._last_heartbeat >= _HEARTBEAT_MIN_INTERVAL_SECS:
            self._heartbeat(now)
        if timed and self.config.calc_timeouts and self._timed_steps == max(1, self.config.warmup_iters):
            self._update_timeouts()  # a first estimate, rather than waiting for the first save

    def checkpointing(self, save: Callable[[TrainProgress], bool], progress: TrainProgress,
                      final: bool = False) -> bool:
        # maybe_save runs every iteration but writes only at its intervals (or, with --async-save, may
        # publish at any iteration): the section is opened only when it may write, saving two round
        # trips to the monitor per iteration.
        may_write = final or self.config.async_save or \
            any(progress.iteration % interval == 0 for interval in self.config.save_intervals)
        opened = may_write and self._section_open("checkpointing")
        saved = save(progress)
        if opened:
            self.client.end_section("checkpointing")
        if saved:
            self._heartbeat()
            self._saves += opened
            if opened and not final and self.config.calc_timeouts:  # after the final one, close() does it
                self._update_timeouts()
        return saved

    def close(self) -> None:
        if self.config.calc_timeouts:
            self._update_timeouts(closing=True)
        self.client.shutdown_workload_monitoring()

    def job_ending(self, exit_code: int) -> None:
        """ft_launcher restarts the workers after any failure, up to --max-restarts: for a code that says the
        same command would fail the same way (8: a fault reproduced from every checkpoint; 3; 17) each of
        those restarts is wasted. Each rank asks its launcher to close the rendezvous instead."""
        if exit_code not in exit_codes.DO_NOT_RETRY:
            return
        from nvidia_resiliency_ext.fault_tolerance.data import WorkloadAction, WorkloadControlRequest

        try:
            self.client.send_workload_control_request(WorkloadControlRequest(
                WorkloadAction.ShutdownWorkload, f"exit code {exit_code}: do not retry"))
        except (OSError, RuntimeError) as err:
            events.warn(f"could not ask ft_launcher not to restart the workers ({type(err).__name__}: "
                        f"{err}); it may restart them up to --max-restarts, each failing the same way")
            return
        events.decision("ft", f"exit code {exit_code} means a restart would fail the same way: asked "
                        "ft_launcher not to restart the workers (ShutdownWorkload)", exit_code=exit_code)


IPC_SOCKET_VARS = ("FT_RANK_MONITOR_IPC_SOCKET", "FT_LAUNCHER_IPC_SOCKET")  # NVRx's names for them


def foreign_ipc_socket() -> str | None:
    """Why one of the IPC sockets ft_launcher gave this rank may be another user's, or None.

    NVRx names them `<temp dir>/_ft_launcher<pid>...socket`: in a shared /tmp any local user can bind such
    a name first, and NVRx's client unpickles what comes back. A socket is trusted when it is this user's,
    in a directory no one else may change (owned by this user or root, and not writable by others unless
    sticky, as /tmp is: there no one else can remove or rename this user's socket). One missing is left to
    NVRx's own error."""
    me = os.geteuid()
    for var in IPC_SOCKET_VARS:
        path = os.environ.get(var)
        if not path:
            continue
        try:
            sock = os.lstat(path)
            where = os.stat(os.path.dirname(os.path.abspath(path)))
        except OSError:
            continue
        if not stat.S_ISSOCK(sock.st_mode):
            return f"{var}={path} is not a socket"
        if sock.st_uid != me:
            return (f"{var}={path} is held by uid {sock.st_uid}, not this rank's uid {me}: another user "
                    "took that name first")
        if where.st_uid not in (me, 0) or (where.st_mode & 0o022 and not where.st_mode & stat.S_ISVTX):
            return (f"{var}={path} is in a directory that others may change (uid {where.st_uid}, mode "
                    f"{stat.S_IMODE(where.st_mode):o})")
    return None


def floor_timeouts(state: Mapping, floor: float) -> tuple[dict, list[str]]:
    """A copy of a RankMonitorClient state_dict with every calculated timeout raised to at least `floor`,
    and the raised ones as "name raw -> floor" notes."""
    state = json.loads(json.dumps(state))  # a deep copy of plain JSON data
    timeouts = state.get(_TIMEOUTS_KEY, {})
    raised: list[str] = []

    def floored(name: str, value: float | None) -> float | None:
        if value is None or value >= floor:
            return value
        raised.append(f"{name} {value:.3g} s -> {floor:g} s")
        return floor

    if "section" in timeouts:
        sections = timeouts["section"]
        for name in sorted(sections.get("calculated_sections", [])):
            if name in sections["section"]:
                sections["section"][name] = floored(name, sections["section"][name])
        if sections.get("is_out_of_section_calculated"):
            sections["out_of_section"] = floored("out-of-section", sections["out_of_section"])
    if "heartbeat" in timeouts and timeouts["heartbeat"].get("were_calculated"):
        for key in ("initial", "subsequent"):
            timeouts["heartbeat"][key] = floored(f"{key} heartbeat", timeouts["heartbeat"][key])
    return state, raised


def merge_saved_timeouts(saved: Mapping, cfg, usable: frozenset[str],
                         floor: float) -> tuple[dict | None, str]:
    """The state to load from a persisted ft_state.json: its *calculated* timeouts (floored) for the
    sections this launcher configures, the launcher's own values for the rest. NVRx would load the file's
    whole table, stale configured values included, over the launcher's."""
    saved, raised = floor_timeouts(saved, floor)
    timeouts = saved.get(_TIMEOUTS_KEY, {})
    state: dict = {_TIMEOUTS_KEY: {}}
    notes = []
    if "section" in timeouts:
        file_sections = timeouts["section"]
        calculated = {s for s in file_sections.get("calculated_sections", []) if s in usable}
        table = dict(cfg.rank_section_timeouts)
        table.update({s: file_sections["section"][s] for s in calculated})
        oos_calculated = bool(file_sections.get("is_out_of_section_calculated"))
        oos = file_sections["out_of_section"] if oos_calculated else cfg.rank_out_of_section_timeout
        if calculated or oos_calculated:
            state[_TIMEOUTS_KEY]["section"] = {"section": table, "out_of_section": oos,
                                               "calculated_sections": sorted(calculated),
                                               "is_out_of_section_calculated": oos_calculated}
            notes.append(", ".join([f"{s} {table[s]:g} s" for s in sorted(calculated)]
                                   + ([f"out-of-section {oos:g} s"] if oos_calculated else [])))
    heartbeat = timeouts.get("heartbeat")
    if heartbeat and heartbeat.get("were_calculated") and heartbeat.get("initial") is not None \
            and heartbeat.get("subsequent") is not None:
        state[_TIMEOUTS_KEY]["heartbeat"] = heartbeat
        notes.append(f"heartbeat initial {heartbeat['initial']:g} s, "
                     f"subsequent {heartbeat['subsequent']:g} s")
    if not state[_TIMEOUTS_KEY]:
        return None, ""
    if raised:
        notes.append(f"raised to the floor --ft-timeouts-floor-secs {floor:g}: {', '.join(raised)}")
    return state, "; ".join(notes)


def _describe_sections(timeouts, only: frozenset[str]) -> str:
    parts = [f"{s} {_secs(timeouts.section.get(s))}" for s in SECTIONS if s in only]
    return ", ".join(parts + [f"out-of-section {_secs(timeouts.out_of_section)}"])


def _secs(value: float | None) -> str:
    return "none" if value is None else f"{value:g} s"
