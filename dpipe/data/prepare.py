"""Before training: find the dataset's items and make sure each has cached latents and text.

Each cache key covers the source file's content, the preprocessing and the encoder's identity,
so an entry made from anything else is simply never found. Ranks split the missing entries
between them, then wait for each other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from tqdm import tqdm

from dpipe.config.schema import DatasetConfig, DatasetKind
from dpipe.data.cache_store import TensorStore, cache_key
from dpipe.data.sources import ImageItem, file_fingerprint, load_image, scan_image_folder
from dpipe.data.synthetic import generate_shapes
from dpipe.errors import DataError
from dpipe.models.spec import ModelSpec

log = logging.getLogger(__name__)
ENCODE_BATCH = 8


@dataclass(frozen=True)
class CachedItem:
    source: Path
    latent_key: str
    text_key: str


class CachedDataset:
    def __init__(self, store: TensorStore, items: list[CachedItem]):
        self.store = store
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def collate(self, indices: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        latents, texts = [], []
        for i in indices:
            item = self.items[i]
            latents.append(self._get(item.latent_key, item)["latents"])
            texts.append(self._get(item.text_key, item))
        text = {name: torch.stack([t[name] for t in texts]) for name in texts[0]}
        return torch.stack(latents), text

    def _get(self, key: str, item: CachedItem) -> dict[str, torch.Tensor]:
        tensors = self.store.get(key)
        if tensors is None:
            raise DataError(
                f"the cache entry for {item.source} vanished from {self.store.root} during "
                "training; do not prune a cache that a run is using"
            )
        return tensors


def dataset_items(cfg: DatasetConfig) -> list[ImageItem]:
    folder = Path(cfg.path).expanduser()
    if cfg.kind == DatasetKind.synthetic:
        generate_shapes(folder, cfg.num_images, cfg.resolution)
    return scan_image_folder(folder)


def prepare(spec: ModelSpec, cfg: DatasetConfig, device: torch.device,
            dtype: torch.dtype) -> CachedDataset:
    """Collective over all ranks (when distributed): returns the same dataset on every rank."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if cfg.resolution % spec.pixel_multiple:
        raise DataError(
            f"dataset.resolution={cfg.resolution} must be a multiple of {spec.pixel_multiple} for "
            f"model.family={spec.family}"
        )
    if rank == 0:
        items = dataset_items(cfg)  # rank 0 generates a synthetic dataset once, for everyone
    _barrier()
    if rank != 0:
        items = dataset_items(cfg)
    image_fp = spec.encoder_fingerprint("image")
    text_fp = spec.encoder_fingerprint("text")
    cached = [
        CachedItem(
            source=item.path,
            latent_key=cache_key(kind="latents", source=file_fingerprint(item.path),
                                 resolution=cfg.resolution, crop="center", encoder=image_fp,
                                 dtype=str(dtype)),
            text_key=cache_key(kind="text", caption=item.caption, encoder=text_fp,
                               dtype=str(dtype)),
        )
        for item in items
    ]
    store = TensorStore(Path(cfg.cache_dir).expanduser())
    by_key = {c.latent_key: (item, "image") for c, item in zip(cached, items)}
    by_key.update({c.text_key: (item, "text") for c, item in zip(cached, items)})
    missing = sorted(k for k in by_key if not store.has(k))
    if rank == 0:
        log.info("cache: %d of %d entries present in %s", len(by_key) - len(missing), len(by_key),
                 store.root)
    mine = missing[rank::world]
    if mine:
        _encode(spec, store, [(k, *by_key[k]) for k in mine], cfg.resolution, device, dtype,
                show=rank == 0)
    _barrier()
    return CachedDataset(store, cached)


def _encode(spec, store, work, resolution, device, dtype, show: bool) -> None:
    encoders = spec.load_encoders(device, dtype)
    images = [(k, item) for k, item, kind in work if kind == "image"]
    texts = [(k, item) for k, item, kind in work if kind == "text"]
    bar = tqdm(total=len(work), desc="caching", unit="entry", disable=not show)
    for i in range(0, len(images), ENCODE_BATCH):
        chunk = images[i:i + ENCODE_BATCH]
        pixels = torch.stack([load_image(item.path, resolution) for _, item in chunk])
        latents = spec.encode_images(encoders, pixels).float().cpu()
        for (key, item), lat in zip(chunk, latents):
            store.put(key, {"latents": lat}, metadata={"source": str(item.path)})
        bar.update(len(chunk))
    for i in range(0, len(texts), ENCODE_BATCH):
        chunk = texts[i:i + ENCODE_BATCH]
        embeds = spec.encode_prompts(encoders, [item.caption for _, item in chunk])
        for j, (key, item) in enumerate(chunk):
            store.put(key, {name: t[j].float().cpu() for name, t in embeds.items()},
                      metadata={"caption": item.caption})
        bar.update(len(chunk))
    bar.close()


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
