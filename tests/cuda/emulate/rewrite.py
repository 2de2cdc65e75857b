"""Rewrites a CUDA source of src/backends/cuda for the CPU emulation (emu.h): kernel launches
`k<<<grid, block, smem, stream>>>(args)` become `::emu::launch(k, grid, block, smem, stream, args)`
and `extern __shared__` buffers become emu::g_smem. Usage: rewrite.py IN OUT."""
import re
import sys

src = open(sys.argv[1]).read()
src = src.replace("extern __shared__ __align__(16) unsigned char smem[];",
                  "unsigned char* smem = ::emu::g_smem;")
src = src.replace("extern __shared__ float smem[];",
                  "float* smem = reinterpret_cast<float*>(::emu::g_smem);")
launch = re.compile(r"([A-Za-z_][A-Za-z0-9_:]*(?:<[^<>;()]*>)?)\s*<<<(.*?)>>>\s*\(", re.S)
src, n = launch.subn(lambda m: "::emu::launch(%s, %s, " % (m.group(1), m.group(2)), src)
if "<<<" in src or "__shared__ __align__" in src:
    sys.exit("rewrite.py: %s: a launch or shared buffer was not rewritten" % sys.argv[1])
open(sys.argv[2], "w").write(src)
