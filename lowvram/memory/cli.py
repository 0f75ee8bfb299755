"""`lowvram doctor`'s command line; it imports no torch, so `lowvram --help` starts at once."""

from __future__ import annotations


def add_doctor_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="check this machine, plan memory for a model and profile, or explain an out-of-memory error",
        description="Without --oom: environment checks and a memory plan (exit 0 = fits; 1 = does not fit, or the "
        "device asked for is not usable here). With --oom: explain an out-of-memory message (the text itself or a "
        "file holding it), a crash report or a torch memory snapshot.",
    )
    add = parser.add_argument
    add("--model", "-m", help="model directory, config.json or hub id (fetches only config.json); default: demo model")
    add("--profile", help="built-in profile or YAML file (default: 4gb with CUDA, cpu without)")
    add("--context", type=int, metavar="N", help="context length to plan for (default: the profile's max_model_len)")
    add("--batch", type=int, default=1, metavar="B", help="sequences of that length at once (default 1)")
    add("--device", choices=["auto", "cuda", "cpu"], help="plan for this device")
    oom_help = "explain an out-of-memory message (pasted in quotes, or a file), a crash report or a memory snapshot"
    add("--oom", metavar="TEXT|FILE", help=oom_help + " ('-' reads stdin)")
    add("--json", action="store_true", help="print one JSON object instead of tables")
    add("--quick", action="store_true", help="skip the checks that start CUDA (Triton kernel test, CUDA context)")
    parser.set_defaults(func=cmd_doctor)


def cmd_doctor(args) -> int:
    from lowvram.memory.doctor import cmd_doctor

    return cmd_doctor(args)
