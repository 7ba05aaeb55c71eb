"""Write the shapes world's prompt files: `python -m shapes --write-prompts` (prompts/shapes_*.jsonl) and
`python -m shapes --write-edit-prompts` (prompts/shapes_edit_*.jsonl and their source PNGs)."""
import argparse

from shapes import edit, world


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m shapes",
                                description="The shapes world: write its prompt files (the held-out evaluation of a "
                                            "model on them is eval.py's; see README, \"The shapes world\").")
    p.add_argument("--write-prompts", action="store_true",
                   help="write prompts/shapes_train.jsonl, shapes_train_hard.jsonl and shapes_test.jsonl")
    p.add_argument("--write-edit-prompts", action="store_true",
                   help="write prompts/shapes_edit_{train,test,unseen}.jsonl and their source PNGs "
                        "(prompts/shapes_edit/)")
    args = p.parse_args(argv)
    if not (args.write_prompts or args.write_edit_prompts):
        p.error("nothing to do: pass --write-prompts or --write-edit-prompts")
    if args.write_prompts:
        world.write_prompts()
    if args.write_edit_prompts:
        edit.write_edit_prompts()


if __name__ == "__main__":
    main()
