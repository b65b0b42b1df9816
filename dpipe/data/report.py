"""The dataset report printed before training: every bucket, and every file dropped or trimmed."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from dpipe.data.manifest import Manifest

LISTED = 20  # lines per list printed; the report file has them all


@dataclass
class DataReport:
    title: str  # "train" or "eval <name>"
    files: int  # usable files found
    directories: int
    micro_batches: int
    data_parallel: int
    manifest: Manifest | None = None
    dropped: list[tuple[str, str]] = field(default_factory=list)
    trimmed: list[tuple[str, str]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what was chosen for the user, and why
    # Clips without sound that train on silence (audio_missing=silence): (file, why).
    silent: list[tuple[str, str]] = field(default_factory=list)
    # Directories whose files are smaller than their bucket, so enlarged to train: {directory:
    # (files, the smallest (width, height))}. Training at 512 on 96 px images blurs them.
    upscaled: dict[str, tuple[int, tuple[int, int]]] = field(default_factory=dict)
    cache: str = ""  # "n of m entries cached, k made now"
    # Video families with frame conditioning: (each mode's probability, how many samples of the
    # run's steps take each mode, the steps).
    frame_modes: tuple[dict[str, float], Counter, int] | None = None

    def rows(self) -> list[tuple]:
        out = []
        dp = self.data_parallel
        for b in self.manifest.buckets if self.manifest else []:
            files = len({s.source for s in b.samples})
            batch = b.micro_batch_size * dp
            out.append((b.name, files, b.size, b.micro_batch_size, b.size // batch,
                        b.size - b.size // batch * batch))
        return out

    def lines(self, full: bool = False) -> list[str]:
        rows = self.rows()
        samples = sum(r[2] for r in rows)
        out = [f"dataset ({self.title}): {self.files} files in {self.directories} "
               f"director{'y' if self.directories == 1 else 'ies'} -> {samples} samples per epoch "
               f"in {len(rows)} bucket(s); {self.cache}"]
        header = ("bucket", "files", "samples", "micro-batch", "batches", "left over")
        widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
        for row in [header, *rows]:
            out.append("  " + "  ".join(str(x).rjust(w) if i else str(x).ljust(w)
                                        for i, (x, w) in enumerate(zip(row, widths))))
        out.append(f"  (a batch is one micro-batch on each of the {self.data_parallel} "
                   "data-parallel rank(s), all from one bucket; 'samples' counts repeats)")
        for title, entries in (("dropped", self.dropped), ("trimmed", self.trimmed),
                               ("silent", self.silent)):
            if entries:
                out.append(f"  {title}: {len(entries)}")
                shown = entries if full else entries[:LISTED]
                out += [f"    {path}: {why}" for path, why in shown]
                if len(shown) < len(entries):
                    out.append(f"    ... and {len(entries) - len(shown)} more (see the report file)")
        for directory, (files, (w, h)) in self.upscaled.items():
            out.append(f"  upscaled: {files} file(s) in {directory} are smaller than their bucket "
                       f"(smallest {w}x{h}) and are enlarged to train; lower dataset.resolutions "
                       "to train them at their own size")
        if self.frame_modes is not None:
            out.append(self._frame_modes_line())
        out += [f"  note: {n}" for n in self.notes]
        out += [f"  warning: {w}" for w in self.warnings]
        return out

    def _frame_modes_line(self) -> str:
        wanted, counts, steps = self.frame_modes
        total = sum(counts.values())
        trained = ", ".join(f"{mode} {counts[mode]} ({counts[mode] / max(1, total):.1%})"
                            for mode, p in wanted.items() if p > 0 or counts[mode])
        asked = ", ".join(f"{mode}={p:g}" for mode, p in wanted.items() if p > 0)
        return (f"  conditioning: of the {total} samples of the run's {steps} steps, {trained} "
                f"(dataset.conditioning: {asked})")

    def write(self, path: Path) -> None:
        from dpipe.io import atomic_write_text

        atomic_write_text(path, "\n".join(self.lines(full=True)) + "\n")
