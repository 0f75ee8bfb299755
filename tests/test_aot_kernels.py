"""scripts/lab/aot_kernels.py: reading cuobjdump's SASS, and compiling the decode attention and
W4A16 kernels for a GPU on a machine without one."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from script_modules import SCRIPTS, load_script

SCRIPT = SCRIPTS / "lab" / "aot_kernels.py"

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/              @!P0 LDG.E.U16 R4, desc[UR4][R2.64] ;
        /*0030*/                   HADD2 R4, R4, -1024, -1024 ;
        /*0040*/                   ISETP.GE.AND P0, PT, R0, 0x10, PT ;
        /*0050*/               @P0 BRA 0x20 ;
        /*0060*/                   FADD R5, R4, R4 ;
        /*0070*/                   BRA 0x60 ;
        /*0080*/                   EXIT ;
"""


@pytest.fixture(scope="module")
def aot():
    return load_script("aot_kernels")


def test_opcodes_drop_predicates_and_modifiers(aot):
    instructions = aot.sass_instructions(SASS)
    assert [address for address, _ in instructions] == list(range(0, 0x90, 0x10))
    assert [aot.opcode(text) for _, text in instructions] == [
        "LDC",
        "S2R",
        "LDG",
        "HADD2",
        "ISETP",
        "BRA",
        "FADD",
        "BRA",
        "EXIT",
    ]


def test_longest_loop_is_the_longest_backward_branch(aot):
    loop = aot.longest_loop(aot.sass_instructions(SASS))
    assert [aot.opcode(text) for text in loop] == ["LDG", "HADD2", "ISETP", "BRA"]
    assert aot.longest_loop(aot.sass_instructions(SASS.replace("BRA 0x20", "BRA 0x80"))) == [
        "FADD R5, R4, R4",
        "BRA 0x60",
    ]


def run_script(*args: str) -> subprocess.CompletedProcess:
    """The script itself, in a process of its own: the interpreter these tests run under
    would hand Triton interpreted functions, which do not compile."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    if not (tools / "cuobjdump").exists() or not any(tools.glob("ptxas*")):
        pytest.skip("this Triton build has no bundled ptxas/cuobjdump")
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


def test_decode_attention_compiles_for_sm90_without_a_gpu():
    result = run_script("attention", "--bits", "8", "--arch", "90")
    found = re.search(
        r"8-bit pages.*: (\d+) registers, (\d+) bytes spilled, loop (\d+) instructions.*'HMMA': (\d+)", result.stdout
    )
    assert found, result.stdout
    registers, spilled, loop, hmma = map(int, found.groups())
    assert 0 < registers <= 255 and spilled == 0
    assert loop > 100 and hmma > 0  # a main loop whose dots run on tensor cores


def test_decode_attention_compiles_for_wide_heads():
    """MLA's 576-wide heads, whose rows span a number of cache lines that is not a power of two,
    at every page precision."""
    result = run_script("attention", "--bits", "16,8,4", "--head-dim", "576", "--block-n", "16", "--warps", "8")
    assert result.stdout.count("bytes spilled") == 3, result.stdout


def test_w4a16_kernels_compile_for_turing_without_a_gpu():
    """Every fused form of the one-row kernel (norm and gate prologues, RoPE + INT4 KV store with
    window pages, compensation computed once or per program) and the tiled kernel compile for
    the GTX 1650's sm_75."""
    result = run_script("gemv", "--arch", "75")
    spills = [int(n) for n in re.findall(r"(\d+) bytes spilled", result.stdout)]
    assert len(spills) == 8 and not any(spills), result.stdout
