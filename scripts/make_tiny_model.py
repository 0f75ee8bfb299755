"""Write a tiny random-weight DeepSeek-shaped checkpoint, e.g. for trying the CLI offline.

python scripts/make_tiny_model.py /tmp/tiny-qwen2 --arch qwen2 --sharded
"""

import argparse

from lowvram.testing import make_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write the checkpoint into")
    parser.add_argument(
        "--arch",
        choices=["llama", "qwen2"],
        default="llama",
        help="llama: deepseek-coder shape; qwen2: R1-Distill-Qwen shape",
    )
    parser.add_argument("--sharded", action="store_true", help="split the weights over several safetensors files")
    parser.add_argument("--seed", type=int, default=0, help="torch seed for the random weights")
    parser.add_argument("--num-layers", type=int, default=2, help="number of decoder layers")
    args = parser.parse_args()
    out_dir = make_tiny_model(args.out, args.arch, sharded=args.sharded, seed=args.seed, num_layers=args.num_layers)
    print(out_dir)


if __name__ == "__main__":
    main()
