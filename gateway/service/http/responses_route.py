"""What ``/v1/responses`` does with stored responses: continue one, keep one, and ``GET`` or
``DELETE /v1/responses/{id}`` -- always within the caller's tenant (``stored_responses``).

A response kept for one tenant is not there for another: the same 404 as for an id nobody made,
whether it is read, deleted or continued.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.config.keys import Principal
from gateway.core.prompt_limits import PromptLimits
from gateway.service.auth import Authenticator
from gateway.service.http.errors import HttpFailure
from gateway.service.http.responses_requests import ResponsesCall, continued, conversation
from gateway.service.http.stored_responses import ResponseStore


class StoredResponsesRoute:
    """The stored-response side of the Responses API.

    Args:
        responses: where responses are kept.
        authenticator: the gateway's keys.
        limits: the prompt's bounds (a continued conversation is checked whole).
        error: how the front answers a failed request (OpenAI's shape).
    """

    def __init__(self, responses: ResponseStore, authenticator: Authenticator,
                 limits: PromptLimits, error: Callable[[BaseException, Request], Response]
                 ) -> None:
        self._responses = responses
        self._auth = authenticator
        self._limits = limits
        self._error = error

    def continued(self, call: ResponsesCall, principal: Principal) -> ResponsesCall:
        """``call`` after the conversation its ``previous_response_id`` names.

        Raises:
            HttpFailure: the caller's tenant kept no such response (404, as for any id).
            InvalidParam: the whole conversation is over the prompt's limits.
        """
        assert call.previous_response_id is not None
        stored = self._responses.get(principal.tenant, call.previous_response_id)
        if stored is None:
            raise HttpFailure(status=404, type="invalid_request_error",
                              code="previous_response_not_found", param="previous_response_id",
                              message=f"Previous response with id "
                                      f"'{call.previous_response_id}' not found.")
        return continued(call, stored.messages, self._limits)

    def keep(self, call: ResponsesCall, body: dict[str, object], text: str) -> None:
        """Keep a finished response and its conversation, for its tenant only."""
        self._responses.put(id=str(body["id"]), tenant=call.request.scope.owner,
                            messages=[*conversation(call), {"role": "assistant",
                                                            "content": text}],
                            body=body, ttl_s=call.ttl_s)

    async def handle(self, request: Request) -> Response:
        """``GET`` or ``DELETE /v1/responses/{id}``."""
        try:
            principal = self._auth.authenticate(request.headers.items(), is_http=True)
            response_id = request.path_params["id"]
            if request.method == "DELETE":
                if self._responses.delete(principal.tenant, response_id):
                    return JSONResponse({"id": response_id, "object": "response.deleted",
                                         "deleted": True})
            elif (stored := self._responses.get(principal.tenant, response_id)) is not None:
                return JSONResponse(dict(stored.body))
            raise HttpFailure(status=404, type="invalid_request_error", code="not_found",
                              message=f"No response with id '{response_id}' found.")
        except Exception as exc:
            return self._error(exc, request)
