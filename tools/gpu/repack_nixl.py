"""Repack NIXL's wheel for a lent GPU machine (tools/gpu/wheels.sh): the call may carry 64 MiB
and the wheel is 59 MB, most of it expert-parallel kernels built for other torch versions
and plugins the engine never loads (it creates the UCX backend only). What is left: 24 MB.

    python3 tools/gpu/repack_nixl.py .whl/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
"""

from __future__ import annotations

import os
import re
import sys
import zipfile

UNUSED = re.compile(r"^nixl_ep_cu13/|libucx_perftest_cuda|/libplugin_(?!UCX\.so)[^/]*\.so$")


def repack(path: str) -> None:
    with zipfile.ZipFile(path) as src:
        kept = [i for i in src.infolist() if not UNUSED.search(i.filename)]
        names = {i.filename for i in kept}
        with zipfile.ZipFile(path + ".new", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for info in kept:
                data = src.read(info)
                if info.filename.endswith(".dist-info/RECORD"):  # only the files still there
                    lines = data.decode().splitlines(keepends=True)
                    data = "".join(x for x in lines if x.split(",")[0] in names).encode()
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(path + ".new", path)


if __name__ == "__main__":
    repack(sys.argv[1])
