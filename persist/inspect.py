"""``peerckpt inspect URL``: what a durable checkpoint root holds, and whether it is intact."""

from __future__ import annotations

from collections import defaultdict

from peerckpt.manifest import META_KEY
from peerckpt.persist.durable import DurableStore
from peerckpt.units import human


def inspect(url: str, step: int | None = None, verify: bool = False) -> tuple[list[str], bool]:
    """Lines describing the checkpoints under ``url``; False if ``verify`` found damage."""
    store = DurableStore(url)
    committed = store.committed_steps()
    incomplete = [s for s in store.all_steps() if s not in committed]
    lines = [f"{url}: committed steps {committed or 'none'}"]
    if incomplete:
        lines.append(f"  never committed (ignored by readers): {incomplete}")
    if not committed and step is None:
        return lines, True
    ckpt = store.open(step)
    m = ckpt.manifest
    files = sorted({c.file for c in m.unique_chunks().values()})
    lines.append(
        f"step {m.step} (epoch {m.epoch}, {m.world_size} ranks): {human(m.nbytes())} in "
        f"{len(files)} file(s) {files}"
    )
    tensors: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    shapes: dict[str, str] = {}
    for chunk in m.unique_chunks().values():
        r = chunk.record
        if r.key == META_KEY:
            continue
        tensors[r.key][0] += 1
        tensors[r.key][1] += r.nbytes
        shapes[r.key] = f"{r.dtype} {list(r.global_shape)}"
    width = max((len(k) for k in tensors), default=0)
    for key in sorted(tensors):
        count, nbytes = tensors[key]
        lines.append(f"  {key:<{width}}  {shapes[key]:<24} {count:>4} chunk(s) {human(nbytes):>10}")
    ok = True
    if verify:
        problems = ckpt.verify()
        ok = not problems
        n = len(m.unique_chunks())
        lines.append(
            f"verified {n} chunk(s): all checksums match"
            if ok
            else f"verification FAILED for {len(problems)} of {n} chunk(s):"
        )
        lines += [f"  {p}" for p in problems]
    return lines, ok
