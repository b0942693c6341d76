"""Environments the tests name by path on a source (`environment: tests.tool_environments:EveryFewTokens`): they
answer a random-weight model, which never writes a ```python block, so that samples really have observations."""

from __future__ import annotations

from megatron_scalerl.tasks.environments import EndEpisode, Environment, Episode, Observation


class EveryFewTokens(Environment):
    """Stops at every token id that is 0 mod 8 and at the pair (5, id 4 mod 8); each stop gets the observation
    " [obs n] " (its tokens), n counting this sample's observations."""

    def __init__(self, context):
        super().__init__(context)
        vocabulary = len(context.tokenizer)
        self.stop_sequences = ([(i,) for i in range(0, vocabulary, 8)]
                               + [(5, i) for i in range(4, vocabulary, 8)])

    def start(self, problem) -> Episode:
        return _Counting(self.context.tokenizer)


class _Counting(Episode):
    def __init__(self, tokenizer):
        self.tokenizer, self.calls = tokenizer, 0

    def step(self, completion_ids):
        self.calls += 1
        return Observation(tuple(self.tokenizer.encode(f" [obs {self.calls}] ", add_special_tokens=False)))


class EndsAtFirstStop(EveryFewTokens):
    """Ends the episode at its first stop with score 1.0 (the environment's own reward)."""

    def start(self, problem) -> Episode:
        episode = Episode()
        episode.step = lambda completion_ids: EndEpisode(1.0)
        return episode


class NoStart(Environment):
    stop_sequences = ((1,),)


class NoStops(EveryFewTokens):
    def __init__(self, context):
        super().__init__(context)
        self.stop_sequences = ()


class BadAnswer(EveryFewTokens):
    def start(self, problem) -> Episode:
        episode = Episode()
        episode.step = lambda completion_ids: "some text"
        return episode
