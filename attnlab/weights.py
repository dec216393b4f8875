"""Loading weights without holding them twice: build the model with its parameters on the
meta device (shapes, no memory), then allocate each parameter once, in the requested dtype
and device, and fill it from the safetensors file(s).

Reading: safetensors files are read with plain positioned reads, a bounded chunk at a
time, straight into the destination tensor when dtype and layout allow. Not through a
memory map (``safe_open``): the pages of a map that have been read stay resident, counted
in the process's memory, until the map is closed, so a model read through one holds the
file and the model at once, twice the memory (measured with benchmarks/load_memory.py).

Shapes: the safetensors format is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} and the raw little-endian data.
"""

from __future__ import annotations

import json
import os
import struct
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

# safetensors dtype names -> torch dtypes
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
CHUNK_BYTES = 16 << 20  # the most read into a temporary buffer at once
_MAX_HEADER = 100 << 20


class WeightsFileError(ValueError):
    """A safetensors file is truncated, corrupt or holds a dtype attnlab cannot read."""


class SafetensorsFile:
    """One safetensors file: its header (names, shapes, dtypes, metadata) read at once, the
    data read on demand with :meth:`read_into`."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        if sys.byteorder != "little":
            raise WeightsFileError("safetensors data is little-endian; this machine is not")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise WeightsFileError(f"{self.path}: too short for a safetensors file")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise WeightsFileError(f"{self.path}: header length {n} is invalid")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise WeightsFileError(f"{self.path}: header is not valid JSON ({e})") from None
        if not isinstance(header, dict):
            raise WeightsFileError(f"{self.path}: header is not a JSON object")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        if not isinstance(self.metadata, dict) or not all(
            isinstance(v, str) for v in self.metadata.values()
        ):  # the format's metadata maps text to text (readers call str methods on it)
            raise WeightsFileError(
                f"{self.path}: __metadata__ is not a JSON object of strings "
                f"({json.dumps(self.metadata)[:80]})"
            )
        self._data_start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype, shape = DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"])
                begin, end = (int(o) for o in e["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise WeightsFileError(
                    f"{self.path}: tensor {name!r} has an unreadable entry {e!r} (dtypes read: "
                    f"{', '.join(DTYPES)})"
                ) from None
            numel = 1
            for s in shape:
                numel *= s
            if end - begin != numel * dtype.itemsize or begin < 0:
                raise WeightsFileError(f"{self.path}: tensor {name!r} has inconsistent offsets")
            if self._data_start + end > size:
                raise WeightsFileError(
                    f"{self.path}: truncated ({size} bytes, tensor {name!r} ends at "
                    f"{self._data_start + end})"
                )
            self.entries[name] = (dtype, shape, self._data_start + begin, numel)
        # One staging buffer for every read of this file: a fresh one per tensor would leave
        # the freed ones resident in the malloc heap, interleaved with the new parameters.
        self._buffer: Tensor | None = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name][1]

    def read_into(
        self,
        name: str,
        dest: Tensor,
        *,
        reshaped: bool = False,
        rows: tuple[int, int] | None = None,
    ) -> None:
        """Copy tensor ``name`` into ``dest`` (same shape; any dtype, strides, device).
        ``reshaped``: ``dest`` holds the stored tensor in another shape of as many elements,
        its values in the stored order (a last dimension split into pairs, say), whose
        leading rows are whole blocks of the stored leading rows (the same leading
        dimension, or one dividing it: (h, 3, d_h, d) for a stored (3 h d_h, d)).
        ``rows`` = (start, stop): only those leading rows of the stored tensor, read as a
        tensor of shape (stop - start, ...) of their own."""
        dtype, shape, offset, numel = self.entries[name]
        if rows is not None:
            start, stop = rows
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"{name}: rows {start}:{stop} are not rows of its shape {shape}")
            per_row = numel // shape[0] if shape[0] else 0
            offset += start * per_row * dtype.itemsize
            shape, numel = (stop - start, *shape[1:]), (stop - start) * per_row
        same = tuple(dest.shape) == shape
        if reshaped:
            same = dest.numel() == numel and dest.dim() > 0 and len(shape) > 0
            lead = dest.shape[0]
            same = same and (lead == shape[0] or (lead > 0 and shape[0] % lead == 0))
        if not same:
            raise ValueError(f"{name}: destination shape {tuple(dest.shape)} != file's {shape}")
        if numel == 0:  # nothing to read (its rows would be 0 bytes each)
            return
        with open(self.path, "rb", buffering=0) as f:
            if dest.dtype == dtype and dest.device.type == "cpu" and dest.is_contiguous():
                # straight into place
                _readinto(f, offset, _bytes_of(dest), self.path)
                return
            # Through a bounded buffer, a block of leading-dimension rows at a time.
            flat_dest = dest if dest.dim() else dest.view(1)  # rows: slices of dim 0
            row = max(1, numel // max(1, flat_dest.shape[0])) * dtype.itemsize
            block = max(1, CHUNK_BYTES // row)
            need = min(block, flat_dest.shape[0]) * row
            if self._buffer is None or self._buffer.numel() < need:
                self._buffer = torch.empty(max(need, min(CHUNK_BYTES, 1 << 20)), dtype=torch.uint8)
            buffer = self._buffer
            for first in range(0, flat_dest.shape[0], block):
                last = min(first + block, flat_dest.shape[0])
                chunk = buffer[: (last - first) * row]
                _readinto(f, offset + first * row, chunk, self.path)
                values = chunk.view(dtype).view(last - first, *flat_dest.shape[1:])
                flat_dest[first:last].copy_(values)

    def read(self, name: str) -> Tensor:
        """Tensor ``name`` as stored (a fresh CPU tensor)."""
        dtype, shape, _, _ = self.entries[name]
        out = torch.empty(shape, dtype=dtype)
        self.read_into(name, out)
        return out


def _bytes_of(t: Tensor) -> Tensor:
    return t.view(-1).view(torch.uint8) if t.dim() else t.view(1).view(torch.uint8)


def _readinto(f, offset: int, dest: Tensor, path: Path) -> None:
    view = memoryview(dest.numpy()).cast("B")
    f.seek(offset)
    done = 0
    while done < len(view):
        n = f.readinto(view[done:])
        if not n:
            raise WeightsFileError(f"{path}: unexpected end of file")
        done += n


# --------------------------------------------------------------------------- models


class _SkipMetaInit(TorchFunctionMode):
    """In-place initialisation of meta tensors (``nn.init.normal_``, ``zero_``, ...) does
    nothing: skip it, and with it the first meta random op's import of torch's Python meta
    kernels (about 170 MB resident, measured with benchmarks/load_memory.py)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        first = args[0] if args else kwargs.get("tensor")  # nn.init passes tensor=
        if (
            name.endswith("_")
            and not name.endswith("__")  # not dunders
            and name != "requires_grad_"
            and isinstance(first, Tensor)
            and first.device.type == "meta"
        ):
            return first
        return func(*args, **kwargs)


@contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules inside this block with every parameter on the meta device (no memory,
    initialisation skipped) and every buffer real, computed as usual: non-persistent buffers
    such as RoPE frequencies are then exact, not recomputed afterwards.

    It patches ``nn.Module.register_parameter`` for the block (not thread-safe)."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            # .to keeps the strides (e.g. attnlab Linear's input-major weight)
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        with _SkipMetaInit():
            yield
    finally:
        nn.Module.register_parameter = original


def materialize(
    model: nn.Module,
    fill: Callable[[str, Tensor], None],
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> nn.Module:
    """Give every meta parameter of ``model`` real memory and fill it with ``fill(name,
    tensor)``, one parameter at a time. Floating parameters get ``dtype`` (default: as
    built; at least float32 for those a module names in ``full_precision``: see
    ``attnlab.nn.moe.KeepsPrecision``), all get ``device`` (default CPU) and the strides
    they were built with; tied parameters stay one tensor (filled once, under their first
    name). Buffers move to ``device`` and keep their dtype (float32 RoPE frequencies are
    not rounded), or widen to a wider ``dtype`` as ``model.to(float64)`` widens them (RoPE
    frequencies recomputed, not cast: a float64 model's angles are float64); persistent
    ones are filled too."""
    device = torch.device(device if device is not None else "cpu")
    persistent = set(model.state_dict())
    made: dict[int, nn.Parameter] = {}
    for qualname, p in list(model.named_parameters(remove_duplicate=False)):
        module_name, _, attr = qualname.rpartition(".")
        module = model.get_submodule(module_name)
        if id(p) not in made:
            dt = dtype if dtype is not None and p.is_floating_point() else p.dtype
            if attr in getattr(module, "full_precision", ()) and dt.itemsize < 4:
                dt = torch.float32  # a router's weights (see attnlab.nn.moe.Router)
            t = torch.empty_strided(p.shape, p.stride(), dtype=dt, device=device)
            with torch.no_grad():
                fill(qualname, t)
            made[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
        module._parameters[attr] = made[id(p)]
    for qualname, b in list(model.named_buffers()):
        module_name, _, attr = qualname.rpartition(".")
        module = model.get_submodule(module_name)
        b = b.to(device)
        if dtype is not None and b.is_floating_point() and dtype.itemsize > b.dtype.itemsize:
            b = b.to(dtype)
        if qualname in persistent:  # saved state (attnlab's models have none so far)
            with torch.no_grad():
                fill(qualname, b)
        module._buffers[attr] = b
    reset_buffers(model)  # RoPE: exact frequencies in the new dtype
    return model


def reset_buffers(model: nn.Module, *, meta_to: torch.device | str | None = None) -> None:
    """Recompute the buffers that no state dict holds (non-persistent: RoPE frequencies, MoE
    token counts) as the constructors make them, through each module's ``reset_buffers()``,
    in each buffer's own dtype (as the model's conversions set it) and on its device.

    With ``meta_to``, only the modules holding a buffer on the meta device (left there by
    ``load_state_dict`` into a model built on the meta device) are reset, their meta
    buffers first given memory on ``meta_to``; buffers of modules without
    ``reset_buffers()`` are left as they are."""
    for module in model.modules():
        if not hasattr(module, "reset_buffers"):
            continue
        if meta_to is not None:
            meta = [k for k, b in module._buffers.items() if b is not None and b.is_meta]
            if not meta:
                continue
            for k in meta:
                module._buffers[k] = torch.empty_like(module._buffers[k], device=meta_to)
        module.reset_buffers()
