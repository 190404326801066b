"""One TRL run of bench/peer_trl_gpu.py, in a process of its own: `python bench/peer_trl_child.py SPEC`.

SPEC (JSON, written by `peer_trl_gpu.run_trl`) holds the model, the recipe, the seed, GRPOConfig's arguments,
the held-out rows molt evaluates (none: no evaluation) and the wall-clock time the process was launched at;
every step appends a line to SPEC's steps file, every evaluation one to its evals file.
"""

from __future__ import annotations

import json
import os
import sys
import time
from itertools import islice
from pathlib import Path

from peer_trl import recipe_reward, trl_dataset


def main(spec_path: str) -> None:
    """The TRL run `run_trl` launches: GRPOTrainer on the spec, a line per step into its steps file and per
    evaluation into its evals file."""
    spec = json.loads(Path(spec_path).read_text())
    from transformers import AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from molt.agent import load_agent

    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    recipe = load_agent(spec["module"])
    config = GRPOConfig(**spec["config"])
    every = config.steps_per_generation // config.gradient_accumulation_steps  # optimizer steps a step

    class StepLog(TrainerCallback):
        """A step ends with the log of its last optimizer step; its reward and reply lengths are in the log
        of its first (TRL logs a generation's figures with the optimizer step that generated it)."""

        def __init__(self) -> None:
            self.logs: list[dict] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "eval_reward" in logs:  # an evaluation: every eval_steps, and after the last step
                # The recipes' rewards are 0 or 1 (smollm2: the reply's last number is the sum; copy_word: the
                # reply starts with the word), and molt's eval/pass@1 (k=1) is the share of samples whose
                # reward reaches --eval.pass_reward 1.0: TRL's mean eval reward, over its one eval batch of
                # all the rows x num_generations_eval samples, is that pass@1.
                evaluation = dict(step=state.global_step // every, t=time.time() - spec["launched"],
                                  pass_at_1=logs["eval_reward"], log=logs)  # fmt: skip
                with open(spec["evals_file"], "a") as out:
                    out.write(json.dumps(evaluation) + "\n")
                return
            if not logs or "loss" not in logs:  # the run's summary, after the last step
                return
            self.logs.append(dict(logs))
            if len(self.logs) < every:
                return
            first = next(log for log in self.logs if "reward" in log)
            step = dict(
                step=state.global_step // every, t=time.time() - spec["launched"], reward=first["reward"],
                reply_tokens=first["completions/mean_length"] * spec["samples"], log=self.logs,
            )  # fmt: skip
            with open(spec["steps_file"], "a") as out:
                out.write(json.dumps(step) + "\n")
            print(f"step {step['step']}/{spec['steps']} | reward {step['reward']:.3f} | "
                  f"{step['t']:.1f}s since launch", flush=True)  # fmt: skip
            self.logs = []

    rows = list(islice(recipe.dataset(spec["seed"]), spec["num_rows"]))
    evaluated = spec["eval_rows"]  # molt's own (`molt._data.eval_rows`), as `run_trl` read them
    eval_name = f"peer-trl-eval-{spec['seed']}-{len(evaluated)}"
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=recipe_reward(recipe),
        args=config,
        train_dataset=trl_dataset(tokenizer, rows, f"peer-trl-{spec['seed']}-{spec['num_rows']}"),
        eval_dataset=trl_dataset(tokenizer, evaluated, eval_name) if evaluated else None,
        processing_class=tokenizer,
        callbacks=[StepLog()],
    )
    trainer.remove_callback(PrinterCallback)  # its dict per log would bury the step lines
    trainer.train()


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main(sys.argv[1])
