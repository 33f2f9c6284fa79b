"""The vLLM engine's process: runs in vLLM's own environment and never imports slipstream.

vLLM pins an older transformers than slipstream's, so the engine lives in an environment of its own
(``make_vllm_venv.sh``) and this script is its whole program. It builds one ``vllm.LLM`` in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the model is in reach for ``load_weights``), says it is
ready, then answers the trainer's requests on a pipe, one JSON message each:

- ``{"op": "load", "path": FILE}``: the tensors of a safetensors file (the policy's merged weights,
  under transformers' names, whole modules) reloaded in place into the engine's model by vLLM's
  ``reload_weights``; the prefix cache is reset (it held the old
  policy's keys and values). With ``--lora-rank``: ``{"op": "lora", "path": DIR}`` makes a PEFT
  adapter directory the one every later request samples with, instead.
- ``{"op": "generate", "prompts": [[ids]], "n": G, "seed": S, ...}``: G completions of each
  prompt (vLLM's ``n``: each prompt prefilled once), the call seeded, with every sampled token's log-prob of the distribution it was drawn from
  (``logprobs_mode="processed_logprobs"``: after temperature, top-k and top-p, as TRL asks for it).
- ``{"op": "close"}``.

Every answer is ``{"ok": ...}`` or ``{"error": "one line"}``; an exception in a request is answered,
not fatal. The trainer watches this process: if it exits, the trainer stops with its log's tail.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from multiprocessing.connection import Connection


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--memory-share", type=float, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-rank", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--read-fd", type=int, required=True)
    parser.add_argument("--write-fd", type=int, required=True)
    return parser.parse_args()


def _build(args):
    from vllm import LLM

    options = dict(
        model=args.model_dir,
        dtype=args.dtype,
        gpu_memory_utilization=args.memory_share,  # on vLLM's CPU backend: the share of host memory
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(4096, args.max_model_len),
        seed=args.seed,
        enable_prefix_caching=True,
        skip_tokenizer_init=True,  # token ids in and out: the trainer's tokenizer decodes
        logprobs_mode="processed_logprobs",
        runner="generate",
    )
    if args.lora_rank:
        options.update(enable_lora=True, max_lora_rank=args.lora_rank, max_loras=1)
    llm = LLM(**options)
    # one token now: what the engine cannot run (an attention shape its kernels lack) fails the start,
    # not the first step
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.generate([TokensPrompt(prompt_token_ids=[0, 1])], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.reset_prefix_cache()
    return llm


class Worker:
    def __init__(self, llm) -> None:
        self.llm = llm
        self.lora = None  # the LoRARequest every generation samples with (--lora-rank)
        self.loras = 0

    def load(self, message: dict) -> dict:
        from safetensors.torch import load_file

        tensors = load_file(message["path"])
        # vLLM's in-place reload: each layer's new checkpoint weights are processed into its kernel's
        # format (on the CPU backend the linear layers' packed weights are rebuilt; a plain
        # load_weights would write into the emptied checkpoint tensors)
        self.llm.collective_rpc(
            "reload_weights", kwargs={"weights_iterator": iter(tensors.items()), "is_checkpoint_format": True}
        )
        self.llm.reset_prefix_cache()
        return {"tensors": len(tensors)}

    def lora_adapter(self, message: dict) -> dict:
        from vllm.lora.request import LoRARequest

        self.loras += 1  # a new id: vLLM caches an adapter by its id
        self.lora = LoRARequest(f"policy-{self.loras}", self.loras, message["path"])
        self.llm.reset_prefix_cache()
        return {"adapter": self.loras}

    def generate(self, message: dict) -> dict:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = [
            SamplingParams(
                n=message["n"],
                temperature=message["temperature"],
                top_p=message["top_p"],
                top_k=message["top_k"] or -1,
                max_tokens=message["max_tokens"],
                stop_token_ids=message["stop_token_ids"],
                logprobs=0,  # the sampled token's own log-prob
            )
            for _ in message["prompts"]
        ]
        # The call is seeded through the process's generator, which vLLM's sampler draws from for
        # requests without a seed of their own (the engine runs in this process). Per-request seeds
        # (SamplingParams.seed) fail on vLLM's CPU backend once a prefill is chunked (its CPU
        # generator has no offset to rewind).
        import torch

        torch.manual_seed(message["seed"])
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in message["prompts"]]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora)
        completions = []
        for output in outputs:
            samples = sorted(output.outputs, key=lambda c: c.index)
            completions.append(
                [
                    {
                        "ids": list(c.token_ids),
                        "logprobs": [
                            step[token].logprob
                            for step, token in zip(c.logprobs or [], c.token_ids, strict=False)
                        ],
                        "finished": c.finish_reason == "stop",
                    }
                    for c in samples
                ]
            )
        return {"completions": completions}


def main() -> int:
    args = _arguments()
    reader, writer = Connection(args.read_fd, writable=False), Connection(args.write_fd, readable=False)
    started = time.perf_counter()
    try:
        import vllm

        worker = Worker(_build(args))
    except Exception as error:  # the trainer shows this line and the log's tail
        traceback.print_exc()
        writer.send_bytes(json.dumps({"error": f"{type(error).__name__}: {error}".splitlines()[0]}).encode())
        return 1
    writer.send_bytes(
        json.dumps({"ok": True, "vllm": vllm.__version__, "start_s": time.perf_counter() - started}).encode()
    )
    handlers = {"load": worker.load, "lora": worker.lora_adapter, "generate": worker.generate}
    while True:
        try:
            message = json.loads(reader.recv_bytes())
        except EOFError:  # the trainer is gone
            return 0
        if message.get("op") == "close":
            writer.send_bytes(b'{"ok": true}')
            return 0
        began = time.perf_counter()
        try:
            answer = {"ok": True, **handlers[message["op"]](message)}
        except Exception as error:
            traceback.print_exc()
            answer = {"error": f"{message.get('op')}: {type(error).__name__}: {error}".splitlines()[0]}
        answer["seconds"] = time.perf_counter() - began
        writer.send_bytes(json.dumps(answer).encode())


if __name__ == "__main__":  # vLLM may spawn processes: the guard keeps them from running this again
    sys.exit(main())
