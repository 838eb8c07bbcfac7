"""A sample's cost from its layout alone (no pixel): what online ISF balances and the log's DistRatio in time counts.

The cost is the run's time model (``omnibal_ext.model.sample_time``, the one ISF in time and ``omnibal plan`` use):
the sample's work (ViT items, the ViT's squared attention segments of each image and video, LLM tokens counted as
ISF counts them, their square) times the cost model's rates of the run's model at its TP on the ISF time device.
The work comes from the layout's kept entries (``record_sample.RecordLayout``): each image's size and ViT items, each
video's sampled frames, frame size, ViT items and temporal patches, read from headers in the loader's workers.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from omnibal_ext.data.online_isf import SampleCost
from omnibal_ext.data.stats import ImageStats, SampleStats, VideoStats
from omnibal_ext.model.sample_time import TimeCoefficients, sample_times, sample_work, with_tokens

from ..images import ImageRule
from ..record_sample import RecordLayout


def layout_stats(layout: RecordLayout, rule: ImageRule) -> SampleStats:
    """The ``SampleStats`` of one sample of ``layout``: its kept images (width, height px, ViT items) and videos
    (sampled frames, frame size px, ViT items, temporal patches), as ``records.scan_media`` gives a scanned sample's."""
    images, videos = [], []
    for k in range(layout.kept):
        (w, h), items, (video, frames, temporal) = layout.sizes[k], layout.items[k], layout.fields[k]
        if video == 0:
            images.append((w, h, items))
        elif k and layout.fields[k - 1][0] == video:  # the next block of the same video
            videos[-1][3] += items
        else:
            videos.append([frames, w, h, items, temporal])
    im = np.asarray(images, dtype=np.int64).reshape(-1, 3)
    image_stats = ImageStats(np.array([0, len(im)], dtype=np.int64), im[:, 0], im[:, 1], im[:, 2])
    video_stats = None
    if videos:
        v = np.asarray(videos, dtype=np.int64)
        video_stats = VideoStats(np.array([0, len(v)], dtype=np.int64), *(v[:, j] for j in range(5)))
    return SampleStats([layout.items_fed(rule)], [layout.tokens], [0], [], image_stats, video_stats)


@dataclass(frozen=True)
class CostModel:
    """The run's cost of a sample (see the module docstring): ``spec`` the model, ``coefficients`` its rates
    (``sample_time.time_coefficients`` at the run's TP and ISF time device), ``token_multiple`` what ISF rounds each
    sample's tokens up to (2 x CP under context parallelism)."""

    spec: object
    coefficients: TimeCoefficients
    token_multiple: int = 1

    def __call__(self, layout: RecordLayout, rule: ImageRule) -> SampleCost:
        """The sample's ``SampleCost``: the ViT items it feeds (dummy ones included), its tokens as ISF counts them,
        its predicted ViT-side and LLM-side seconds (forward + backward)."""
        stats = layout_stats(layout, rule)
        grids = [rule.grid(int(w), int(h)) for w, h in zip(stats.images.width, stats.images.height)]
        rows_cols = None
        if grids and all(g is not None for g in grids):
            rows_cols = (np.array([g[1] for g in grids], np.int64), np.array([g[2] for g in grids], np.int64))
        m = self.token_multiple
        tokens = -(-layout.tokens // m) * m
        work = with_tokens(sample_work(stats, self.spec, rows_cols), np.array([tokens]))
        vit, llm = sample_times(work, self.coefficients)
        return SampleCost(int(layout.items_fed(rule)), int(tokens), float(vit[0]), float(llm[0]))
