"""``peerckpt inspect URL``: what a durable checkpoint root holds, and whether it is intact.

By default a summary that fits a screen whatever the model's size: the committed steps, and
for one step its epoch, ranks, bytes, tensor and chunk counts, files, and the verification
status. The per-tensor listing (thousands of lines on a real model) only with ``tensors``.
Only reads; verification reads every chunk and checks its checksum. A root that holds no
checkpoint (nothing there, a file, an empty directory) raises NoCheckpoint; one holding only
steps that were never committed is listed, and reported as not ok.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from peerckpt.errors import NoCheckpoint
from peerckpt.manifest import META_KEY
from peerckpt.persist.durable import DurableStore
from peerckpt.units import human


def inspect(
    url: str,
    step: int | None = None,
    verify: bool = False,
    tensors: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[list[str], bool]:
    """Lines describing the checkpoints under ``url``; False if ``verify`` found damage.
    ``progress`` is told (chunks verified, chunks in all) while verifying."""
    store = DurableStore(url)
    _check_root(store)
    committed = store.committed_steps()
    incomplete = [s for s in store.all_steps() if s not in committed]
    if not committed and not incomplete:
        raise NoCheckpoint(
            f"{url} holds no checkpoint (no step-* directory): give the URL a job wrote its "
            "checkpoints to (peerckpt run --persist, @resilient(persist=…))"
        )
    lines = [f"{url}: committed steps {committed or 'none'}"]
    if incomplete:
        lines.append(f"  never committed (ignored by readers): {incomplete}")
    if not committed and step is None:
        lines.append("  no committed step: nothing here can be loaded")
        return lines, False
    ckpt = store.open(step)
    m = ckpt.manifest
    chunks = m.unique_chunks().values()
    files = sorted({c.file for c in chunks})
    by_tensor: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    shapes: dict[str, str] = {}
    for chunk in chunks:
        r = chunk.record
        if r.key == META_KEY:
            continue
        by_tensor[r.key][0] += 1
        by_tensor[r.key][1] += r.nbytes
        shapes[r.key] = f"{r.dtype} {list(r.global_shape)}"
    tensor_bytes = sum(n for _, n in by_tensor.values())
    lines += [
        f"step {m.step} (epoch {m.epoch}, {m.world_size} ranks): {human(m.nbytes())}",
        f"  tensors: {len(by_tensor)} in {sum(c for c, _ in by_tensor.values())} chunk(s), "
        f"{human(tensor_bytes)}; per-rank state: {human(m.nbytes() - tensor_bytes)}",
        f"  files: {len(files)} ({', '.join(files[:4])}{', …' if len(files) > 4 else ''})",
    ]
    if tensors:
        width = max((len(k) for k in by_tensor), default=0)
        for key in sorted(by_tensor):
            count, nbytes = by_tensor[key]
            lines.append(
                f"  {key:<{width}}  {shapes[key]:<24} {count:>4} chunk(s) {human(nbytes):>10}"
            )
    ok = True
    if verify:
        problems = ckpt.verify(progress)
        ok = not problems
        n = len(chunks)
        lines.append(
            f"  verified: {n} chunk(s), all checksums match"
            if ok
            else f"  verification FAILED for {len(problems)} of {n} chunk(s):"
        )
        lines += [f"    {p}" for p in problems]
    else:
        lines.append("  verified: no (add --verify to read every chunk and check it)")
    if not tensors:
        lines.append("  (--tensors lists every tensor)")
    return lines, ok


def _check_root(store: DurableStore) -> None:
    """NoCheckpoint unless the root is a directory (on an object store, a prefix with
    objects under it): a missing path or a file is named as such, not listed as empty."""
    if not store.fs.exists(store.root):
        raise NoCheckpoint(
            f"nothing at {store.url} (no such file or directory); give the URL a job wrote its "
            "checkpoints to (peerckpt run --persist, @resilient(persist=…))"
        )
    if not store.fs.isdir(store.root):
        raise NoCheckpoint(
            f"{store.url} is a file, not a checkpoint root (a directory holding step-* "
            "directories and a 'latest' pointer)"
        )
