"""Reading a cubin (an ELF64 file) without a GPU: the kernels it defines.

Checking the symbol at build time turns a typo in ``kernel=`` or a missing ``extern "C"`` (a C++
mangled name) into a clear error on the build machine instead of ``CUDA_ERROR_NOT_FOUND`` at the
first launch on a GPU.
"""

from __future__ import annotations

import struct

_SHT_SYMTAB = 2
_STT_FUNC = 2
_STO_CUDA_ENTRY = 0x10  # st_other bit nvcc sets on __global__ functions


def kernel_symbols(image: bytes) -> list[str]:
    """Names of the ``__global__`` functions defined in cubin ``image`` (raises ``ValueError`` if not ELF64)."""
    if len(image) < 64 or image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not a little-endian ELF64 cubin")
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    if shentsize < 64 or shoff + shnum * shentsize > len(image):
        raise ValueError("truncated ELF section table")
    sections = []
    for i in range(shnum):
        base = shoff + i * shentsize
        _, sh_type, _, _, sh_offset, sh_size, sh_link, _, _, sh_entsize = struct.unpack_from(
            "<IIQQQQIIQQ", image, base
        )
        sections.append((sh_type, sh_offset, sh_size, sh_link, sh_entsize))
    names: list[str] = []
    for sh_type, off, size, link, entsize in sections:
        if sh_type != _SHT_SYMTAB or entsize < 24 or link >= len(sections):
            continue
        str_off, str_size = sections[link][1], sections[link][2]
        if off + size > len(image) or str_off + str_size > len(image):
            raise ValueError("truncated ELF symbol table")
        for s in range(off, off + size - entsize + 1, entsize):
            st_name, st_info, st_other, st_shndx = struct.unpack_from("<IBBH", image, s)
            if (st_info & 0xF) != _STT_FUNC or st_shndx == 0 or not (st_other & _STO_CUDA_ENTRY):
                continue
            start = str_off + st_name
            end = image.find(b"\0", start, str_off + str_size)
            if end < 0:
                raise ValueError("unterminated ELF symbol name")
            names.append(image[start:end].decode("utf-8", "replace"))
    return names
