"""Rollouts on vLLM servers (`rl.engine: vllm`), over HTTP with the standard library only: the trainer never imports
vllm (its CPU build pins a transformers older than ours), so the servers run from another environment (docs/vllm.md).

One responsibility per module:
- `settings`: the `rl.vllm` section (`VLLMSettings`) and the engine's error (`EngineError`);
- `server`: a server rank 0 launches (`VLLMServer`) and its process group; `boot`: that server's first process (run as
  a file by vLLM's interpreter, standard library only) and how the group ends;
- `client`: rank 0's HTTP client of the servers (requests with the API key, errors naming the URL, readiness, prompt
  log-probabilities, a wave of sampling requests spread over the servers);
- `pool`: which servers serve (`Pool`): a dead server's samples go to the others, a launched one is relaunched
  (`max_restarts`) and rejoins;
- `check`: whether a server serves the trainer's weights after a sync (`SyncCheck`);
- `sync`: the weight sync's parts (writing the safetensors, each server's reload and cache resets, the checks);
- `engine`: `VLLMEngine`, the `RolloutEngine` composing them into collectives over the trainer's ranks.
"""

from veomni_lite.engines.vllm.check import SyncCheck
from veomni_lite.engines.vllm.client import spread
from veomni_lite.engines.vllm.engine import VLLMEngine
from veomni_lite.engines.vllm.server import VLLMServer, free_port
from veomni_lite.engines.vllm.settings import EngineError, VLLMSettings

__all__ = ["EngineError", "SyncCheck", "VLLMEngine", "VLLMServer", "VLLMSettings", "free_port", "spread"]
