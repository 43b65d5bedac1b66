import httpx

from tests.integration.conftest import MODEL, Graph


async def test_chat_through_graph(graph: Graph) -> None:
    async with httpx.AsyncClient(base_url=graph.url, timeout=30) as c:
        r = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5})
        print(r.status_code, r.text)
        assert r.status_code == 200
        r = await c.get("/status")
        print(r.text)
