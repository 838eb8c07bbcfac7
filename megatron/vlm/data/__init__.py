"""Data pipeline of the VLM trainer: tokenizer, chat template, the record reader and its image rules (dynamic
tiling among them), the built-in digits dataset, micro-batch collation and per-sample statistics
(torch/PIL/numpy only)."""
from .collate import BATCH_KEYS, HOST_KEYS, check_batch, check_image_tokens, collate_packed, collate_padded, packing
from .digits import build_digits_dataset, digits_meta_paths
from .images import ImageRule, TileImages
from .records import (DataValidationError, ReaderConfig, RecordDataset, ScanResult, SourceSpec, read_meta,
                      scan_annotations)
from .stats import stats_records, write_stats
from .template import (IGNORE_INDEX, ChatPlan, ConversationError, parse_conversations, plan_conversation,
                       render_conversation)
from .tiling import (IMAGENET_MEAN, IMAGENET_STD, black_tile_tensor, candidate_grids, choose_grid, count_tiles,
                     dynamic_tiles, tiles_to_tensor)
from .tokenizer import SPECIAL_TOKENS, ByteTokenizer, HFTokenizer, build_tokenizer, padded_vocab_size

__all__ = [
    "BATCH_KEYS", "HOST_KEYS", "check_batch", "check_image_tokens", "collate_packed", "collate_padded", "packing",
    "build_digits_dataset", "digits_meta_paths",
    "ImageRule", "TileImages",
    "DataValidationError", "RecordDataset", "ReaderConfig", "ScanResult", "SourceSpec", "read_meta",
    "scan_annotations",
    "stats_records", "write_stats",
    "IGNORE_INDEX", "ChatPlan", "ConversationError", "parse_conversations", "plan_conversation",
    "render_conversation",
    "IMAGENET_MEAN", "IMAGENET_STD", "black_tile_tensor", "candidate_grids", "choose_grid", "count_tiles",
    "dynamic_tiles", "tiles_to_tensor",
    "SPECIAL_TOKENS", "ByteTokenizer", "HFTokenizer", "build_tokenizer", "padded_vocab_size",
]
