"""E2E: POST /v1/tokens/count on the demo server agrees with vLLM's own usage; bad input gets OpenAI errors."""
import json
import urllib.error
import urllib.request

from qwen_vllm_ext.demo import SERVED_NAME


def post(server, body: bytes):
    req = urllib.request.Request(server.base_url + "/v1/tokens/count", data=body,
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_count_matches_vllm_usage(demo_server, openai_client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello 世界 👋"}]
    usage = openai_client.chat.completions.create(model=SERVED_NAME, messages=messages, max_tokens=1).usage
    status, body = post(demo_server, json.dumps({"messages": messages, "completion": "ok"}).encode())
    assert status == 200, body
    assert body["model"] == SERVED_NAME
    assert body["prompt_tokens"] == usage.prompt_tokens and body["completion_tokens"] == 1
    assert body["billing"]["policy"] == "default" and isinstance(body["billing"]["total_units"], str)
    status, body = post(demo_server, json.dumps({"prompt": "hello world"}).encode())
    assert status == 200 and body["prompt_tokens"] == 2


def test_bad_requests_get_openai_errors(demo_server):
    for raw, code in ((b"{oops", "invalid_json"), (b"[]", "invalid_request"), (b"{}", "missing_input"),
                      (json.dumps({"prompt": "a", "messages": []}).encode(), "missing_input"),
                      (json.dumps({"prompt": 7}).encode(), "invalid_request"),
                      (json.dumps({"messages": [{"content": "no role"}]}).encode(), "invalid_request"),
                      (json.dumps({"messages": "hi"}).encode(), "invalid_request")):
        status, body = post(demo_server, raw)
        assert status == 400, raw
        assert body["error"]["code"] == code and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"]
