"""How long our HTTP servers keep an idle client connection open.

uvicorn closes one after 5 s, and httpx (the openai SDK's transport) keeps an idle
connection pooled for 5 s as well: a request sent on a pooled connection just as the server
closes it fails with "Server disconnected without sending a response" (RemoteProtocolError),
which no one caused and clients do not retry. A server must keep idle connections longer
than its clients pool them (vLLM made this configurable for the same race); 65 s also
outlasts the 60 s idle timeout common to cloud load balancers in front of a router.
"""

IDLE_KEEP_ALIVE_S = 65
