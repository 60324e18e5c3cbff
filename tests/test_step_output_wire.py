"""What crosses the replica -> ingress hop: StepOutput pickled as plain values, every field kept."""
import dataclasses
import pickle

from ray import cloudpickle

from engine.outputs import ChoiceDelta, PromptLogprob, StepOutput


def test_a_step_output_pickles_as_plain_values_and_comes_back_equal():
    assert [f.name for f in dataclasses.fields(ChoiceDelta)] == [  # __reduce__ lists them in this order
        "index", "text", "token_ids", "logprobs", "finish_reason", "stop_reason"]
    assert [f.name for f in dataclasses.fields(StepOutput)] == [
        "choices", "num_prompt_tokens", "num_cached_tokens", "finished", "prompt_logprobs", "pooled"]
    step = StepOutput([ChoiceDelta(0, " hi", [5, 6], [{5: -0.5, 9: -1.5}, {6: -0.1}], "stop", "</s>"),
                       ChoiceDelta(2, "é", [7], None, None, None)], 12, 4, True,
                      [None, PromptLogprob(3, -2.0, 4, ((8, -1.0),))])
    for dumps in (pickle.dumps, cloudpickle.dumps):
        data = dumps(step)
        assert pickle.loads(data) == step
        assert b"ChoiceDelta" not in data  # the choices went as tuples
    embedded = StepOutput([ChoiceDelta(0, "", [], None, "stop")], 7, 0, True, pooled=[0.25, -1.5, 3e-8])
    for dumps in (pickle.dumps, cloudpickle.dumps):
        assert pickle.loads(dumps(embedded)) == embedded  # a pooling request's vector goes with it
    one_token = StepOutput([ChoiceDelta(0, " hello", [1234], None)], 32, 0, False)
    assert len(pickle.dumps(one_token)) < 100  # the dataclasses took 254 bytes
