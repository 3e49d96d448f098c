"""DESIGN.md §6: bad input gets an OpenAI-shaped 4xx and the server keeps serving."""

from __future__ import annotations

import base64

import httpx
import pytest

from tests.engine.server.images import data_url, image_message, png_bytes

pytestmark = pytest.mark.slow


def post(url: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)


def chat(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {
        "model": "tiny-llava",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    body.update(overrides)
    return body


def assert_openai_error(response: httpx.Response, status: int, needle: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert needle in error["message"], error["message"]


def image_content(url: str) -> list[dict[str, object]]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "x"}]


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        (chat(model="gpt-4"), 404, "does not exist"),
        (chat(messages=[]), 400, "messages"),
        (chat(temperature=5), 400, "temperature"),
        (chat(top_p=0), 400, "top_p"),
        (chat(max_tokens=0), 400, "max_tokens"),
        (chat(n=2), 400, "n"),
        (chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
        (chat(max_tokens=100000), 400, "context window"),
        (chat(messages=[{"role": "user", "content": "word " * 600}]), 400, "context window"),
        (chat(messages=[{"role": "robot", "content": "hi"}]), 400, "role"),
        (
            chat(
                messages=[{"role": "user", "content": image_content("data:image/png;base64,@@@")}]
            ),
            400,
            "base64",
        ),
        (
            chat(
                messages=[
                    {
                        "role": "user",
                        "content": image_content(
                            "data:image/png;base64," + base64.b64encode(b"not an image").decode()
                        ),
                    }
                ]
            ),
            400,
            "cannot decode image",
        ),
        (
            chat(messages=[{"role": "user", "content": image_content(data_url(1, (400, 400)))}]),
            400,
            "larger than",
        ),
        (chat(messages=[image_message("many", 1, 2, 3, 4)]), 400, "at most 3"),
        (
            chat(messages=[{"role": "user", "content": image_content("ftp://example/x.png")}]),
            400,
            "data: or http(s)",
        ),
    ],
)
def test_bad_request_gets_clear_4xx(
    instance_url: str, body: dict[str, object], status: int, needle: str
) -> None:
    assert_openai_error(post(instance_url, body), status, needle)


def test_malformed_json_gets_400_and_server_keeps_serving(instance_url: str) -> None:
    response = httpx.post(
        f"{instance_url}/v1/chat/completions",
        content=b'{"model": "tiny-llava", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert_openai_error(response, 400, "JSON")
    ok = post(instance_url, chat(messages=[image_message("still fine?", 5)]))
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] >= 1


def test_oversized_image_fixture_really_is_over_the_limit() -> None:
    assert len(png_bytes(1, (400, 400))) > 300_000


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/internal/requests"),
        ("POST", "/internal/migrations"),
        ("POST", "/internal/transfer/collective/connect"),
        ("POST", "/internal/migrations/x/release"),
    ],
)
@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_internal_endpoints_need_the_shared_token(
    instance_url: str, method: str, path: str, token: str | None
) -> None:
    headers = {"X-EPD-Token": token} if token else {}
    response = httpx.request(method, f"{instance_url}{path}", json={}, headers=headers)
    assert_openai_error(response, 403, "X-EPD-Token")
