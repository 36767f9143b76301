"""Engines and servers the suites start: the engine spec (specs), the in-process client
(client: Engine, EngineCoreWatch), the functions that run inside vLLM's workers through
collective_rpc (workers), the configurations every suite and the warm step start
(engine_configs), the OpenAI API server (servers) and its prefill/decode client (disagg)."""
