"""The commands of `python -m megatron_resil.tools.ckpt` (megatron_resil/tools/ckpt.py says what each does).
Importing this module imports megatron-core: the entry point installs the start-up patches first.

What they read is untrusted: every line goes out through events.say (names escaped, no encoding error on
any stdout), and no walk of a directory follows a link or recurses."""

from __future__ import annotations

import os
import stat

from megatron_resil import checkpointing
from megatron_resil.checkpointing import GlobalTier, TierCandidate, newest_first
from megatron_resil.events import say


class OfflineLocalTier:
    """The local tier as this machine sees it, without a running job: a candidate iteration is
    loadable if every rank's shard has at least one verified copy in some rank directory."""

    name = "local"

    def __init__(self, root: str) -> None:
        self.root = root
        self.copies = checkpointing.inspect_local_copies(root)
        rank_dirs = [p for p in os.listdir(root) if p.isdigit()] if os.path.isdir(root) else []
        owners = [o for by_owner in self.copies.values() for o in by_owner]
        self.world = max([len(rank_dirs), *(o + 1 for o in owners)], default=0)

    def candidates(self) -> list[TierCandidate]:
        return [TierCandidate("local", it, checkpointing.local_iteration_path(self.root, it),
                              "node-local shards") for it in sorted(self.copies, reverse=True)]

    def verify(self, candidate: TierCandidate) -> str | None:
        by_owner = self.copies[candidate.iteration]
        for owner in range(self.world):
            copies = by_owner.get(owner, {})
            if not any(why is None for why in copies.values()):
                seen = "; ".join(f"copy on rank {h}: {why}" for h, why in sorted(copies.items()))
                return f"rank {owner}'s shard has no verified copy ({seen or 'no copy found'})"
        return None

    def describe(self, iteration: int) -> list[str]:
        lines = []
        for owner, copies in sorted(self.copies[iteration].items()):
            held = ", ".join(f"rank {h}: {'ok' if why is None else why}" for h, why in sorted(copies.items()))
            lines.append(f"    rank {owner}'s shard: {held}")
        return lines


def _size(path: str) -> str:
    """The regular files' bytes in MiB, and what kept any from being counted."""
    size, short = checkpointing.tree_size(path)
    return f"{size / 2**20:10.1f} MiB" + (f" ({short})" if short else "")


def cmd_list(root: str, local: str | None, non_persistent: str | None) -> int:
    say(f"persistent tier {root}")
    _list_global(root)
    if non_persistent:
        say(f"non-persistent global tier {non_persistent}")
        _list_global(non_persistent)
    if local:
        say(f"local tier {local}")
        tier = OfflineLocalTier(local)
        for iteration in sorted(tier.copies, reverse=True):
            say(f"  iteration {iteration}")
            for line in tier.describe(iteration):
                say(line)
        for reason in sorted(_glob_reasons(local)):
            say(f"  quarantined {reason}")
    return 0


def _reason(path: str) -> str:
    """A quarantine note; whatever stands under its name (a FIFO, a link) is named, never opened."""
    try:
        return checkpointing.read_untrusted_text(path, 64 << 10, "quarantine note").strip()
    except (OSError, UnicodeDecodeError, checkpointing.CheckpointDataError) as err:
        return f"? ({err})"


def _is_real_dir(path: str) -> bool:
    """A directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _glob_reasons(root: str) -> list[str]:
    found = []
    for rank in sorted(os.listdir(root)) if os.path.isdir(root) else []:  # the root is the user's
        quarantine = checkpointing.LOCAL_QUARANTINE_DIR
        qdir = os.path.join(root, rank, quarantine)
        if not (_is_real_dir(os.path.join(root, rank)) and _is_real_dir(qdir)):
            continue
        for name in sorted(os.listdir(qdir)):
            if name.endswith(".REASON.txt"):
                reason = _reason(os.path.join(qdir, name))
                found.append(f"{rank}/{quarantine}/{name[:-len('.REASON.txt')]}: {reason}")
    return found


def _list_global(root: str) -> None:
    reading = checkpointing.read_tracker(root)
    tracker = "release" if reading.iteration == -1 else reading.iteration
    say(f"tracker: {tracker if reading.problem is None else reading.problem}")
    for iteration in checkpointing.published_iterations(root):
        path = checkpointing.iteration_dir(root, iteration)
        if os.path.islink(path):  # listed, never followed: verify rejects it
            say(f"  iter_{iteration:07d}  a symlink to {os.readlink(path)}")
            continue
        manifest, _ = checkpointing.read_manifest(path)
        kind = f"manifest v{manifest.get('version')}" if manifest else "no manifest"
        say(f"  iter_{iteration:07d}  {_size(path)}  {kind}")
    for path in checkpointing.quarantined(root):
        reason_file = os.path.join(path, "QUARANTINE_REASON.txt")
        reason = _reason(reason_file) if os.path.lexists(reason_file) else "?"
        say(f"  quarantined {os.path.basename(path)}: {reason}")
    for kind, paths in checkpointing.leftovers(root).items():
        for path in paths:
            say(f"  leftover ({kind}) {os.path.basename(path)}: removed at the next start of a run "
                "that saves here")


def tiers(root: str, local: str | None, non_persistent: str | None) -> list:
    """In pretrain.py's order of trust at equal iterations."""
    tiers: list = [GlobalTier(root)]
    if local:
        tiers.insert(0, OfflineLocalTier(local))
    if non_persistent:
        tiers.append(GlobalTier(non_persistent, name="non-persistent"))
    return tiers


def cmd_verify(tiers: list, iteration: int | None) -> int:
    failed = 0
    for tier, candidate in newest_first(tiers):
        if iteration is not None and candidate.iteration != iteration:
            continue
        reason = tier.verify(candidate)
        if reason is not None:
            verdict = f"FAILED: {reason}"
        elif candidate.tier == "local":
            verdict = "ok (every rank's shard has a copy matching its owner's checksum)"
        elif checkpointing.has_manifest(candidate.path):
            also = ", SHA-256s Megatron-LM's integrity.json" \
                if checkpointing.has_integrity_manifest(candidate.path) else ""
            verdict = f"ok (sizes and checksums match the manifest{also})"
        elif checkpointing.has_integrity_manifest(candidate.path):
            verdict = "ok (no manifest; SHA-256s match Megatron-LM's integrity.json)"
        else:
            verdict = "ok (no manifest: its files read through the allow-list, no checksums)" \
                if checkpointing.is_torch_checkpoint(candidate.path) else \
                "ok (no manifest: presence of .metadata only)"
        failed += reason is not None
        say(f"{candidate.tier} iteration {candidate.iteration}: {verdict}")
    return 1 if failed else 0


def cmd_which(tiers: list) -> int:
    for tier, candidate in newest_first(tiers):
        reason = tier.verify(candidate)
        where = f"{candidate.tier} iteration {candidate.iteration} ({candidate.path})"
        if reason is None:
            say(f"would load {where}: verified, {candidate.note}")
            return 0
        say(f"would reject {where}: {reason}")
    say("nothing loadable in " + ", ".join(tier.root for tier in tiers))
    return 1
