"""What checking every byte costs a load: checked vs unchecked reads of the same files, in one process.

A folder flaxheads wrote records the xxh3-64 digest of every block of every file (``checksums.json``);
loading checks each block as it reads it. This bench writes one safetensors file of each size asked
(float32 tensors of 4-64 MiB and a few small ones, random bytes) and an Orbax checkpoint of the same
size, and times, interleaved (docs/performance.md's rules):

* ``eager``: ``read_safetensors`` (the whole file, one pass; checked) vs the same reader unchecked, and
  safetensors' own ``load_file`` (what flaxheads used before) for reference;
* ``tensors``: ``SafetensorsFile.read`` tensor by tensor in file order (what the sharded loader does per
  process), checked vs unchecked;
* ``orbax``: a checkpoint item's restore with its files checked first (``io.restore_arrays``) vs Orbax's
  restore alone;
* ``fh.load``: a whole BERT-shaped transformers folder of that size (random weights, ``checksums.json``
  as an export writes it) loaded by ``fh.load``, vs the same with the manifest ignored (``--no-model``
  leaves it out).

Each kind is timed on its own, checked and unchecked calls alternating (ABBA), each after the heap's
free pages were returned.
Page cache warm, and cold: the files' pages dropped before every timed call (``posix_fadvise
DONTNEED`` on the files; ``--drop-caches``: ``echo 3 > /proc/sys/vm/drop_caches``, root only). Prints
medians (min..max) and the checked / unchecked ratio of each. ``--block-sizes 1,4,8,16`` instead times
the checked eager read with manifests of those block sizes (MiB), warm: how the block size was chosen.

    .venv/bin/python bench/checked_load.py --sizes 400M,2G --repeats 5
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import numpy as np  # noqa: E402
from common import cpu_name, parser  # noqa: E402


def _size(text: str) -> int:
    text = text.strip().upper()
    unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1], 1)
    return int(float(text.rstrip("KMG")) * unit)


def _tensors(nbytes: int, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 tensors adding up to about ``nbytes``: mostly 16 MiB, some 4 and 64 MiB, a few small ones."""
    rng = np.random.default_rng(seed)
    out, total, i = {}, 0, 0
    for name, shape in (("emb", (30522, 384)), ("norm", (384,)), ("bias", (1536,))):
        out[name] = rng.standard_normal(shape, dtype=np.float32)
        total += out[name].nbytes
    sizes = [16 << 20, 4 << 20, 16 << 20, 64 << 20]
    while total < nbytes:
        n = min(sizes[i % len(sizes)], nbytes - total) // 4 * 4 or 4
        out[f"layer.{i}.weight"] = rng.integers(-(2**31), 2**31 - 1, n // 4, dtype=np.int32).view(np.float32)
        total, i = total + n, i + 1
    return out


def _write(folder: str, nbytes: int, checkpoint: bool) -> tuple[str, str | None]:
    """A safetensors file of ``nbytes`` with its manifest, and (``checkpoint``) an Orbax step of the same tensors."""
    from safetensors.numpy import save_file

    from flaxheads.disk import checksums

    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "model.safetensors")
    tensors = _tensors(nbytes)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(folder, checksums.MANIFEST)):
        save_file(tensors, path, metadata={"format": "pt"})
        checksums.write_manifest(folder)
    root = None
    if checkpoint:
        from flaxheads.checkpoint import io

        root = os.path.join(folder, "ckpt")
        if not os.path.isdir(os.path.join(root, "1")):
            shutil.rmtree(root, ignore_errors=True)
            mgr = io.manager(root, async_save=False)
            mgr.save(1, args=io.save_args({"head": tensors}, {"meta": {"bench": True}}))
            mgr.wait_until_finished()
            mgr.close()
            io.seal_step(root, 1)
    return path, root


def _bert_folder(folder: str, nbytes: int) -> str:
    """A BERT classifier folder of about ``nbytes`` (hidden 1024, as many layers as fit), random float32
    weights, with its manifest (what ``fh.export`` writes for it)."""
    import json

    import torch
    from safetensors.numpy import save_file
    from transformers import BertConfig, BertForSequenceClassification

    from flaxheads.disk import checksums

    path = os.path.join(folder, "bert")
    if os.path.isfile(os.path.join(path, checksums.MANIFEST)):
        return path
    layers = max(1, round((nbytes / 4 - 32e6) / 12.6e6))
    cfg = BertConfig(
        hidden_size=1024, num_hidden_layers=layers, num_attention_heads=16, intermediate_size=4096, num_labels=3
    )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in BertForSequenceClassification(cfg).state_dict().items()}
    rng = np.random.default_rng(0)
    os.makedirs(path, exist_ok=True)
    save_file(
        {k: (0.02 * rng.standard_normal(s, dtype=np.float32)) for k, s in shapes.items()},
        os.path.join(path, "model.safetensors"),
        metadata={"format": "pt"},
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg.to_dict(), "architectures": ["BertForSequenceClassification"]}, f)
    checksums.write_manifest(path)
    return path


def _drop(paths: list[str], system_wide: bool) -> None:
    if system_wide:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return
    for top in paths:
        walk = [(top, [], [""])] if os.path.isfile(top) else os.walk(top)
        for d, _, names in walk:
            for name in names:
                fd = os.open(os.path.join(d, name), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def _unchecked(call):
    """``call`` with every manifest ignored: the same reads, nothing checked (a folder written elsewhere)."""
    from flaxheads.disk import checksums

    def run():
        real = checksums.read_manifest
        checksums.read_manifest = lambda folder: None
        try:
            call()
        finally:
            checksums.read_manifest = real

    return run


def _systems(path: str, root: str | None, model: str | None):
    """``{name: call}``: each call loads once and returns nothing (its result dropped)."""
    import jax

    import flaxheads as fh
    from flaxheads.backbones.safetensors_file import SafetensorsFile
    from flaxheads.backbones.weights import read_safetensors
    from flaxheads.disk import checksums

    def tensors():
        with SafetensorsFile(path) as f:
            for name in sorted(f.tensors, key=lambda n: f.tensors[n].offset):
                f.read(name)

    def load_file():
        from safetensors.numpy import load_file as lf

        lf(path)

    def eager():
        read_safetensors(path)

    out = {
        "eager checked": eager,
        "eager unchecked": _unchecked(eager),
        "eager safetensors.load_file": load_file,
        "tensors checked": tensors,
        "tensors unchecked": _unchecked(tensors),
    }
    if root is not None:
        import orbax.checkpoint as ocp

        from flaxheads.checkpoint import io

        mgr = io.manager(root, read_only=True)
        target = io.item_targets(mgr, root, 1, ["head"])

        def restore(check):
            def run():
                checksums.forget()  # checked again on every call, as a fresh process would
                if check:
                    got = io.restore_arrays(mgr, root, 1, target)
                else:
                    got = mgr.restore(1, args=ocp.args.Composite(head=ocp.args.StandardRestore(target["head"])))
                jax.block_until_ready(got["head"])

            return run

        out.update({"orbax checked": restore(True), "orbax unchecked": restore(False)})
    if model is not None:

        def load():
            checksums.forget()
            jax.block_until_ready(fh.load(model).params)

        out.update({"fh.load checked": load, "fh.load unchecked": _unchecked(load)})
    return out


def _time(systems: dict, repeats: int, cold: bool, drop_paths: list[str], system_wide: bool) -> dict[str, list[float]]:
    """Seconds of each call, ``repeats`` each. Each kind (eager, tensors, orbax, fh.load) is timed on its own,
    its checked and unchecked calls alternating in ABBA order: each follows a call of its own kind as
    often as the other does (an Orbax restore leaves work behind that slows the next call, whatever it
    is). The heap's free pages are returned and (``cold``) the files' pages dropped before each call."""
    import gc

    from flaxheads.runtime.malloc import release_free_memory

    times: dict[str, list[float]] = {k: [] for k in systems}
    kinds: dict[str, list[str]] = {}
    for name in systems:
        kinds.setdefault(name.split()[0], []).append(name)
    for group in kinds.values():
        for name in group:  # first calls (imports, Orbax's first restore), untimed
            systems[name]()
        for r in range(repeats):
            for name in group if r % 2 == 0 else group[::-1]:
                gc.collect()
                release_free_memory()
                if cold:
                    _drop(drop_paths, system_wide)
                t0 = time.perf_counter()
                systems[name]()
                times[name].append(time.perf_counter() - t0)
    return times


def _report(label: str, times: dict[str, list[float]]) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        print(f"  {label:5s} {k:30s} {med[k]:7.3f} s  ({min(v):.3f}..{max(v):.3f})")
    for kind in ("eager", "tensors", "orbax", "fh.load"):
        if f"{kind} checked" in med:
            c, u = times[f"{kind} checked"], times[f"{kind} unchecked"]
            ratio = med[f"{kind} checked"] / med[f"{kind} unchecked"]
            print(
                f"  {label:5s} {kind:8s} checked / unchecked = {ratio:.3f} (medians), {min(c) / min(u):.3f} (fastest)"
            )


def _block_sizes(folder: str, nbytes: int, sizes_mib: list[float], repeats: int) -> None:
    from flaxheads.disk import checksums

    path, _ = _write(folder, nbytes, checkpoint=False)
    systems = _systems(path, None, None)
    for kind in ("eager safetensors.load_file",):
        systems.pop(kind)
    for mib in sizes_mib:
        checksums.BLOCK = int(mib * (1 << 20))
        checksums.write_manifest(folder)
        t = _time(systems, repeats, False, [], False)
        med = {k: statistics.median(v) for k, v in t.items()}
        print(
            f"  block {mib:4g} MiB: "
            + ", ".join(
                f"{kind} {med[f'{kind} checked']:.3f} / {med[f'{kind} unchecked']:.3f} s = "
                f"{med[f'{kind} checked'] / med[f'{kind} unchecked']:.3f}"
                for kind in ("eager", "tensors")
            )
            + f" (load average {os.getloadavg()[0]:.1f})"
        )


def checksums_block() -> int:
    from flaxheads.disk import checksums

    return checksums.BLOCK


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--sizes", default="400M,2G")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dir", default="/tmp/flaxheads-bench-checked")
    ap.add_argument("--no-orbax", action="store_true")
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--drop-caches", action="store_true", help="drop the whole page cache (root) instead of the files'")
    ap.add_argument("--block-sizes", default=None, help="MiB, comma-separated: time the checked read per block size")
    ap.add_argument("--keep", action="store_true", help="keep the files written under --dir")
    args = ap.parse_args()
    print(
        f"CPU: {cpu_name()} ({os.cpu_count()} cores); load average {os.getloadavg()[0]:.1f}; block "
        f"{checksums_block() >> 20} MiB"
    )
    try:
        if args.block_sizes:
            _block_sizes(
                os.path.join(args.dir, "blocks"),
                _size(args.sizes.split(",")[0]),
                [float(x) for x in args.block_sizes.split(",")],
                args.repeats,
            )
            return
        for text in args.sizes.split(","):
            folder = os.path.join(args.dir, text)
            path, root = _write(folder, _size(text), checkpoint=not args.no_orbax)
            model = None if args.no_model else _bert_folder(folder, _size(text))
            orbax = ""
            if root:
                step_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs)
                orbax = f", Orbax step {step_bytes / 1e6:.0f} MB"
            print(f"{text}: {os.path.getsize(path) / 1e6:.0f} MB safetensors{orbax}")
            systems = _systems(path, root, model)
            _report("warm", _time(systems, args.repeats, False, [], False))
            _report("cold", _time(systems, args.repeats, True, [folder], args.drop_caches))
            print(f"  load average {os.getloadavg()[0]:.1f}")
    finally:
        if not args.keep:
            shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
