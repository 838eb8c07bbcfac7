"""The images and videos of a chat request, as local files the generator reads.

An ``image_url`` or ``video_url`` part names its medium by one URL:

* ``data:<mime>;base64,<bytes>``: the bytes are written to a file in the request's own folder (removed when the
  request is done), named by their hash, with the extension of the MIME type (PIL and PyAV read the content,
  not the name);
* ``file:///abs/path`` or an absolute path: a file on the server's machine (a video may also be a frame folder, as
  in the trainer's records);
* anything else (``http(s)://`` URLs, relative paths) is refused: the server fetches nothing over the network and
  has no working directory in common with its clients.

Each medium is checked before the request joins a batch: an image is decoded whole (PIL), a video probed and its
first frame decoded (the trainer's ``video_decode``), so a broken file is the client's 400, not a batch's failure.
Refusals are ``MediaError`` (a ``UserError``) naming the message part.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import shutil
import tempfile
import urllib.parse
from dataclasses import dataclass

from PIL import Image, UnidentifiedImageError

from megatron.vlm.data.video_decode import VideoError, decode_frames, probe_video
from omnibal_ext.errors import UserError

EXTENSIONS = {"image/png": ".png", "image/jpeg": ".jpg", "image/jpg": ".jpg", "image/gif": ".gif",
              "image/webp": ".webp", "image/bmp": ".bmp", "image/tiff": ".tiff", "video/mp4": ".mp4",
              "video/webm": ".webm", "video/x-matroska": ".mkv", "video/quicktime": ".mov", "video/avi": ".avi",
              "video/x-msvideo": ".avi"}


class MediaError(UserError):
    """An image or video part the server cannot read; the message names the part (``messages[i].content[j]``)."""


@dataclass(frozen=True)
class MediaKind:
    """``part_type``: the OpenAI part type ("image_url", "video_url"); ``trainer_type``: the part type of the
    trainer's structured ``messages`` ("image", "video"); ``mime_prefix``: what a data URL's type starts with."""

    part_type: str
    trainer_type: str
    mime_prefix: str


IMAGE = MediaKind("image_url", "image", "image/")
VIDEO = MediaKind("video_url", "video", "video/")


class RequestMedia:
    """The folder holding one request's decoded data URLs (created on first use under ``root``, or the system's
    temporary folder; removed by ``close``)."""

    def __init__(self, root: str | None = None):
        self._root = root
        self._folder: str | None = None

    def local_path(self, url: str, kind: MediaKind, where: str) -> str:
        """The local file (or frame folder) of ``url``, checked readable as ``kind``; ``where`` names the part."""
        if not isinstance(url, str) or not url:
            raise MediaError(f"{where}: the {kind.part_type} needs a non-empty 'url' string")
        if url.startswith("data:"):
            path = self._write_data_url(url, kind, where)
        else:
            path = _local_file(url, kind, where)
        check_readable(path, kind, where)
        return path

    def _write_data_url(self, url: str, kind: MediaKind, where: str) -> str:
        header, comma, payload = url[len("data:"):].partition(",")
        mime, _, encoding = header.partition(";")
        if not comma or encoding != "base64":
            raise MediaError(f"{where}: a data URL must read data:<type>;base64,<data> (got {url[:40]!r}...)")
        if mime and not mime.startswith(kind.mime_prefix):
            raise MediaError(f"{where}: a {kind.part_type} holds a {mime!r} data URL; expected {kind.mime_prefix}*")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as e:
            raise MediaError(f"{where}: the data URL's base64 does not decode ({e})") from None
        if not data:
            raise MediaError(f"{where}: the data URL holds no bytes")
        if self._folder is None:
            self._folder = tempfile.mkdtemp(prefix="omnibal-serve-", dir=self._root)
        name = hashlib.sha256(data).hexdigest()[:32] + EXTENSIONS.get(mime, ".bin")
        path = os.path.join(self._folder, name)
        with open(path, "wb") as f:
            f.write(data)
        return path

    def close(self) -> None:
        """Remove the files this request's data URLs were written to."""
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None


def _local_file(url: str, kind: MediaKind, where: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme == "file":
        path = urllib.parse.unquote(parsed.path)
    elif parsed.scheme in ("http", "https", "ftp", "s3", "gs"):
        raise MediaError(f"{where}: {parsed.scheme}:// URLs are not fetched (the server reads no network); send a "
                         "data URL (data:<type>;base64,...) or a path on the server's machine")
    else:
        path = url
    if not os.path.isabs(path):
        raise MediaError(f"{where}: {url!r} is neither a data URL nor an absolute path (file:///... or /...)")
    if not os.path.exists(path):
        raise MediaError(f"{where}: {path}: no such file or directory")
    if os.path.isdir(path) and kind is not VIDEO:
        raise MediaError(f"{where}: {path} is a folder; only a video may be a frame folder")
    return path


def check_readable(path: str, kind: MediaKind, where: str) -> None:
    """Refuse (``MediaError``) an image PIL cannot decode, or a video whose header or first frame PyAV (a frame
    folder: PIL) cannot read."""
    if kind is IMAGE:
        try:
            with Image.open(path) as image:
                image.load()
        except (UnidentifiedImageError, OSError, Image.DecompressionBombError, SyntaxError, ValueError) as e:
            raise MediaError(f"{where}: the image is unreadable ({' '.join(str(e).split())})") from None
        return
    try:
        decode_frames(path, probe_video(path), [0])
    except VideoError as e:
        raise MediaError(f"{where}: {e}") from None
