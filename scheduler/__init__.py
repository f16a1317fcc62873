"""The serving engine: continuous batching over the paged KV cache with a Llama-family model."""

from scheduler.beam_search import BeamSearch, BeamSearchOutput, BeamSearchParams
from scheduler.config import CacheConfig, EngineConfig, SchedulerConfig
from scheduler.engine import LLMEngine
from scheduler.llm import LLM
from scheduler.model import LlamaModel, ModelConfig
from scheduler.outputs import CompletionOutput, RequestOutput
from scheduler.params import SamplingParams
from scheduler.weights import from_hf_model, from_state_dict

__all__ = [
    "BeamSearch", "BeamSearchOutput", "BeamSearchParams", "CacheConfig", "CompletionOutput", "EngineConfig",
    "LLM", "LLMEngine", "LlamaModel", "ModelConfig", "RequestOutput", "SamplingParams", "SchedulerConfig",
    "from_hf_model", "from_state_dict",
]
