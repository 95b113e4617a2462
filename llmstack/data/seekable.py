"""Decompressing readers of gzip and zstd files that a resume can restart inside the file, at a
cost that does not grow with the position.

While a file is read, its reader records seek points (`SeekPoint`) behind it:
- gzip: at the end of a deflate block, at least `GZIP_SPACING` decompressed bytes after the
  previous point: the compressed byte offset, the bits of the byte before it that belong to the
  next block, and the 32 KiB of decompressed data before the point (deflate refers back at most
  that far). This is zlib's `examples/zran.c`; Python's `zlib` module does not expose `Z_BLOCK`,
  `inflatePrime` or a raw stream's dictionary, so the reader calls the same libz the interpreter
  loaded, through ctypes (the `z_stream` layout and these calls have been zlib's public ABI since
  1.2.2.4; zlib-ng's compatible build keeps them). Without a loadable libz, gzip files are read
  by the `gzip` module and a resume decompresses from the start of the file.
- zstd: at the start of every frame after the first. A zstd decoder's state inside a frame cannot
  be saved, so a resume restarts at the frame its place is in: files written as many frames
  (`pzstd`, the seekable format, any writer that starts a frame every few MB) resume in the time
  of one frame; a file that is one frame (what `zstd` writes by default) is decompressed from its
  start up to the place.

A resumed reader opens the file at a point at or before its place and decompresses forward from
there, so it yields the same bytes as a reader from the start. Restarting inside a gzip member
cannot check that member's CRC (its start was not read); the members after it are checked.
"""

import base64
import collections
import ctypes
import ctypes.util
import functools
import io
import zlib
from dataclasses import dataclass
from typing import Any

GZIP_SPACING = 2**20  # decompressed bytes between gzip seek points (zran.c's span)
WINDOW = 32768  # deflate's largest distance back
CHUNK = 2**16  # compressed bytes read from the file at a time
PENDING = 16  # recorded points not yet passed by the reader's position, kept (the oldest go first)


@dataclass(frozen=True)
class SeekPoint:
    """Where a decompressor can restart: `compressed`, the file offset of the next input byte;
    `uncompressed`, the offset of the decompressed stream there; for gzip, `bits` of the byte
    before `compressed` that belong to the next deflate block and the `window` of decompressed
    data before the point (zstd: frame starts, neither)."""

    compressed: int
    uncompressed: int
    bits: int = 0
    window: bytes = b""

    @functools.cached_property
    def _json(self) -> dict[str, Any]:
        state: dict[str, Any] = {"compressed": self.compressed, "uncompressed": self.uncompressed}
        if self.bits:
            state["bits"] = self.bits
        if self.window:  # 16 KB of JSON for English prose, 44 KB for incompressible data
            state["window"] = base64.b64encode(zlib.compress(self.window)).decode("ascii")
        return state

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable (the window deflated and base64-encoded)."""
        return dict(self._json)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> "SeekPoint":
        window = zlib.decompress(base64.b64decode(state["window"])) if "window" in state else b""
        return cls(state["compressed"], state["uncompressed"], state.get("bits", 0), window)


class SeekableReader(io.RawIOBase):
    """A decompressed file, read forward from its start or from a `SeekPoint`; `point_before`
    gives the seek point to restart at for a place the reader has passed."""

    def __init__(self, path: str, start: SeekPoint | None = None) -> None:
        self._file = open(path, "rb")
        self._pos = 0  # decompressed offset of the next byte returned
        self._points: collections.deque[SeekPoint] = collections.deque(maxlen=PENDING)
        self._point = start
        self._start = start

    def point_before(self, position: int) -> SeekPoint | None:
        """The latest recorded point at or before decompressed offset `position` (the one the
        reader was opened at, or None: the start of the file, when none is), for positions
        given in increasing order, none beyond what the reader has returned."""
        while self._points and self._points[0].uncompressed <= position:
            self._point = self._points.popleft()
        return self._point

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        """Forward by decompressing and dropping; backward by reopening (at the opening point
        when the target is not before it)."""
        target = {io.SEEK_SET: offset, io.SEEK_CUR: self._pos + offset}.get(whence)
        if target is None or target < 0:
            raise OSError(f"cannot seek to {offset} from {whence} in a compressed file")
        if target < self._pos:
            start = self._start if self._start is not None and self._start.uncompressed <= target else None
            self._restart(start)
        scratch = bytearray(min(2**20, max(target - self._pos, 1)))
        while self._pos < target:
            view = memoryview(scratch)[: min(len(scratch), target - self._pos)]
            if not self.readinto(view):
                break
        return self._pos

    def _restart(self, start: SeekPoint | None) -> None:
        raise NotImplementedError

    def _record(self, point: SeekPoint) -> None:
        self._points.append(point)

    def close(self) -> None:
        if not self.closed:
            self._file.close()
        super().close()


class _ZStream(ctypes.Structure):
    _fields_ = [
        ("next_in", ctypes.c_void_p),
        ("avail_in", ctypes.c_uint),
        ("total_in", ctypes.c_ulong),
        ("next_out", ctypes.c_void_p),
        ("avail_out", ctypes.c_uint),
        ("total_out", ctypes.c_ulong),
        ("msg", ctypes.c_char_p),
        ("state", ctypes.c_void_p),
        ("zalloc", ctypes.c_void_p),
        ("zfree", ctypes.c_void_p),
        ("opaque", ctypes.c_void_p),
        ("data_type", ctypes.c_int),
        ("adler", ctypes.c_ulong),
        ("reserved", ctypes.c_ulong),
    ]


Z_OK, Z_STREAM_END, Z_BUF_ERROR, Z_BLOCK = 0, 1, -5, 5
GZIP_WBITS, RAW_WBITS = 31, -15


@functools.cache
def libz() -> Any:
    """The libz the interpreter's zlib module uses (None where none can be loaded)."""
    for find in ("libz.so.1", "libz.dylib", "z", "zlib"):
        name = find if "." in find else ctypes.util.find_library(find)
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.zlibVersion.restype = ctypes.c_char_p
        pointer = ctypes.POINTER(_ZStream)
        lib.inflateInit2_.argtypes = [pointer, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.inflate.argtypes = [pointer, ctypes.c_int]
        lib.inflateEnd.argtypes = [pointer]
        lib.inflatePrime.argtypes = [pointer, ctypes.c_int, ctypes.c_int]
        lib.inflateSetDictionary.argtypes = [pointer, ctypes.c_char_p, ctypes.c_uint]
        return lib
    return None


class GzipReader(SeekableReader):
    """A gzip file (one member or several) decompressed through libz with seek points every
    `GZIP_SPACING` bytes; errors as the `gzip` module's: OSError for a damaged file, EOFError for
    a truncated one."""

    def __init__(self, path: str, start: SeekPoint | None = None, spacing: int | None = None) -> None:
        super().__init__(path, start)
        self._lib, self._spacing = libz(), GZIP_SPACING if spacing is None else spacing
        self._strm = _ZStream()
        self._live = False  # whether _strm holds an inflate state
        self._input = ctypes.create_string_buffer(CHUNK)
        self._restart(start)

    def _restart(self, start: SeekPoint | None) -> None:
        self._tail = bytearray()  # the last decompressed bytes (at least WINDOW once there are)
        self._done = False
        self._point, self._points = start, collections.deque(maxlen=PENDING)
        self._pos = self._last = start.uncompressed if start is not None else 0
        self._in_start = start.compressed if start is not None else 0  # file offset of the input buffer
        self._in_size = 0
        self._file.seek(self._in_start)
        self._strm.avail_in = 0
        if start is None:
            self._new_member(first=True)
            return
        self._begin(RAW_WBITS)
        if start.bits:
            self._file.seek(start.compressed - 1)
            byte = self._file.read(1)
            if not byte:
                raise EOFError(f"{self._file.name}: the file ends before its seek point")
            self._check(self._lib.inflatePrime(self._strm, start.bits, byte[0] >> (8 - start.bits)))
        self._check(self._lib.inflateSetDictionary(self._strm, start.window, len(start.window)))
        self._tail[:] = start.window

    def _begin(self, wbits: int) -> None:
        """A new inflate state, keeping the input not yet consumed."""
        self._end_stream()
        self._raw = wbits < 0
        self._live = True
        self._check(self._lib.inflateInit2_(self._strm, wbits, self._lib.zlibVersion(), ctypes.sizeof(_ZStream)))

    def _end_stream(self) -> None:
        if self._live:
            self._lib.inflateEnd(self._strm)
            self._live = False

    def _check(self, code: int) -> None:
        if code != Z_OK:
            message = self._strm.msg.decode("ascii", "replace") if self._strm.msg else f"zlib error {code}"
            raise OSError(f"{self._file.name}: {message}")

    def _fill(self) -> bool:
        """Refill the input buffer when it is used up; False at the end of the file."""
        if self._strm.avail_in:
            return True
        self._in_start += self._in_size
        self._in_size = self._file.readinto(self._input)
        self._strm.next_in = ctypes.addressof(self._input)
        self._strm.avail_in = self._in_size
        return self._in_size > 0

    def _take(self, n: int) -> bytes:
        """The next `n` input bytes (fewer at the end of the file), outside the decompressor."""
        data = b""
        while len(data) < n and self._fill():
            k = min(n - len(data), self._strm.avail_in)
            data += ctypes.string_at(self._strm.next_in, k)
            self._strm.next_in += k
            self._strm.avail_in -= k
        return data

    def _new_member(self, first: bool = False) -> None:
        """Start the next gzip member, after zero padding (as the `gzip` module allows), or stop."""
        while True:
            byte = self._take(1)
            if not byte:
                self._end_stream()
                self._done = True
                return
            if byte != b"\0" or first:
                break
        self._strm.next_in -= 1  # give the byte back to the decompressor (it is still in the buffer)
        self._strm.avail_in += 1
        self._begin(GZIP_WBITS)

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        size = len(view)
        if not size:
            return 0
        out = (ctypes.c_char * size).from_buffer(view)
        strm = self._strm
        while not self._done:
            self._fill()
            strm.next_out = ctypes.addressof(out)
            strm.avail_out = size
            code = self._lib.inflate(strm, Z_BLOCK)
            produced = size - strm.avail_out
            if code == Z_BUF_ERROR and not produced and not strm.avail_in:
                raise EOFError(f"{self._file.name}: compressed file ended before the end-of-stream marker was reached")
            if code not in (Z_OK, Z_STREAM_END, Z_BUF_ERROR):
                self._check(code)
            self._pos += produced
            if produced >= WINDOW:
                self._tail[:] = view[produced - WINDOW : produced]
            elif produced:
                self._tail += view[:produced]
                if len(self._tail) > 4 * WINDOW:
                    del self._tail[:-WINDOW]
            if code == Z_STREAM_END:
                if self._raw and len(self._take(8)) < 8:  # restarted inside a member: its CRC and size, unchecked
                    raise EOFError(f"{self._file.name}: the gzip trailer is cut off")
                self._new_member()
            elif strm.data_type & 128 and not strm.data_type & 64 and self._pos - self._last >= self._spacing:
                self._last = self._pos
                compressed = self._in_start + self._in_size - strm.avail_in
                self._record(SeekPoint(compressed, self._pos, strm.data_type & 7, bytes(self._tail[-WINDOW:])))
            if produced:
                return produced
        return 0

    def close(self) -> None:
        self._end_stream()
        super().close()


class ZstdReader(SeekableReader):
    """A zstd file (one frame or several, skippable frames included) with a seek point at every
    frame start after the first; ZstdError for a damaged file, EOFError for a truncated one."""

    def __init__(self, path: str, start: SeekPoint | None = None) -> None:
        import zstandard

        super().__init__(path, start)
        self._decompressor = zstandard.ZstdDecompressor()
        self._restart(start)

    def _restart(self, start: SeekPoint | None) -> None:
        self._point, self._points = start, collections.deque(maxlen=PENDING)
        self._pos = start.uncompressed if start is not None else 0
        self._consumed = start.compressed if start is not None else 0  # file offset of the next input byte
        self._file.seek(self._consumed)
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False  # whether the current frame has had input
        self._output, self._offset = b"", 0  # decompressed bytes not yet returned: _output[_offset:]
        self._input = b""  # input after the end of the last frame, not yet decompressed
        self._eof = False

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        while self._offset == len(self._output) and not self._eof:
            self._decompress()
        n = min(len(view), len(self._output) - self._offset)
        view[:n] = self._output[self._offset : self._offset + n]
        self._offset += n
        self._pos += n
        return n

    def _decompress(self) -> None:
        """Decompress the next input, up to the end of a frame, which records a seek point at the
        next one (one a call, so that points follow the reader's position closely)."""
        data = self._input or self._file.read(CHUNK)
        self._input = b""
        if not data:
            if self._in_frame:
                raise EOFError(f"{self._file.name}: compressed file ended before the end-of-stream marker was reached")
            self._eof = True
            return
        self._in_frame = True
        self._output, self._offset = self._frame.decompress(data), 0
        if not self._frame.eof:
            self._consumed += len(data)
            return
        self._input = self._frame.unused_data
        self._consumed += len(data) - len(self._input)
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False
        self._record(SeekPoint(self._consumed, self._pos + len(self._output)))


def open_seekable(path: str, compression: str, start: SeekPoint | None = None) -> io.BufferedIOBase | None:
    """A buffered reader of a gzip/zstd file's decompressed bytes from its start or from `start`,
    whose `.raw` is a `SeekableReader`; None for gzip where libz cannot be loaded."""
    if compression == "gzip":
        if libz() is None:
            return None
        raw: SeekableReader = GzipReader(path, start)
    elif compression == "zstd":
        raw = ZstdReader(path, start)
    else:
        raise ValueError(f"no seekable reader for {compression!r}")
    return io.BufferedReader(raw, buffer_size=2**17)


def point_tracker(f: Any) -> Any:
    """`f`'s seek point lookup by position (`SeekableReader.point_before`), or one that has none."""
    raw = getattr(f, "raw", None)
    return raw.point_before if isinstance(raw, SeekableReader) else lambda position: None
