"""A stand-in for ``slipstream/engines/vllm_worker.py`` that speaks its protocol without vLLM.

It answers ``load`` / ``lora`` at once and ``generate`` with seeded random tokens of the model's
vocabulary, each with a log-prob of -log(vocab) + 0.01 (so the trainer's differ from them, as
vLLM's do). ``FAKE_VLLM_DIE_AT=N``: exit with code 3 on the Nth ``generate``;
``FAKE_VLLM_FAIL_START=1``: answer the start with an error. ``FAKE_VLLM_CALLS``: a file each request's
op is appended to (what the trainer asked, in order); ``FAKE_VLLM_MESSAGES``: a file each
``generate`` request and its answer are appended to, one JSON line each."""

import argparse
import json
import math
import os
import random
import sys
from multiprocessing.connection import Connection


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in (
        "--model-dir",
        "--dtype",
        "--max-model-len",
        "--memory-share",
        "--seed",
        "--lora-rank",
        "--read-fd",
        "--write-fd",
    ):
        parser.add_argument(name)
    args = parser.parse_args()
    reader = Connection(int(args.read_fd), writable=False)
    writer = Connection(int(args.write_fd), readable=False)
    if os.environ.get("FAKE_VLLM_FAIL_START"):
        writer.send_bytes(json.dumps({"error": "ValueError: no such model type 'fake'"}).encode())
        return 1
    with open(os.path.join(args.model_dir, "config.json")) as file:
        config = json.load(file)
    assert os.path.exists(os.path.join(args.model_dir, "model.safetensors"))
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    writer.send_bytes(json.dumps({"ok": True, "vllm": "fake", "start_s": 0.0}).encode())
    generated = 0
    calls = os.environ.get("FAKE_VLLM_CALLS")
    while True:
        try:
            message = json.loads(reader.recv_bytes())
        except EOFError:
            return 0
        if calls:
            with open(calls, "a") as out:
                out.write(message["op"] + "\n")
        if message["op"] == "close":
            writer.send_bytes(b'{"ok": true}')
            return 0
        if message["op"] == "generate":
            generated += 1
            if os.environ.get("FAKE_VLLM_DIE_AT") == str(generated):
                print("fake engine: dying as asked", flush=True)
                os._exit(3)
            completions = []
            for index in range(len(message["prompts"])):
                group = []
                for g in range(message["n"]):
                    draw = random.Random(f"{message['seed']} {index} {g}")
                    length = draw.randint(1, message["max_tokens"])
                    ids = [draw.randrange(vocab) for _ in range(length)]
                    group.append(
                        {
                            "ids": ids,
                            "logprobs": [-math.log(vocab) + 0.01] * length,
                            "finished": length < message["max_tokens"],
                        }
                    )
                completions.append(group)
            if os.environ.get("FAKE_VLLM_MESSAGES"):
                with open(os.environ["FAKE_VLLM_MESSAGES"], "a") as out:
                    out.write(json.dumps({"request": message, "completions": completions}) + "\n")
            writer.send_bytes(json.dumps({"ok": True, "completions": completions, "seconds": 0.0}).encode())
        else:
            writer.send_bytes(json.dumps({"ok": True, "seconds": 0.0}).encode())


if __name__ == "__main__":
    sys.exit(main())
