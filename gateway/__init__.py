"""The gateway: the stack's public text API (GatewayService) in front of the tokenizer and model services.

A request's path: validate -> tokenizer Encode -> model Generate stream (one of several replicas) ->
tokenizer DecodeStream (incremental detokenization) -> stop sequences -> text deltas to the caller.
"""
