"""Errors in the OpenAI shape {"error": {"message", "type", "param", "code"}} for every status the
server answers with, and the handlers that turn validation and JSON errors into 400s."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltaserve.server.reqlog import request_refused

TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
         501: "not_supported_error", 503: "unavailable_error"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None,
                 param: str | None = None, **extra) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.extra = (status, message, code,
                                                                        param, extra)


def error_body(status: int, message: str, code: str | None = None, param: str | None = None,
               **extra) -> dict:
    return {"error": {"message": message, "type": TYPES.get(status, "server_error"),
                      "param": param, "code": code, **extra}}


# Anthropic's error types, for the /v1/messages routes (server/anthropic.py)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 503: "overloaded_error"}


def error_response(status: int, message: str, code: str | None = None,
                   param: str | None = None, *, path: str = "", **extra) -> JSONResponse:
    """The error in the shape the route's clients parse: Anthropic's under /v1/messages,
    OpenAI's everywhere else."""
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if path.startswith("/v1/messages"):
        body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "api_error"),
                                           "message": message}}
        return JSONResponse(body, status_code=status, headers=headers)
    return JSONResponse(error_body(status, message, code, param, **extra), status_code=status,
                        headers=headers)


def context_overflow(num_prompt: int, max_len: int, requested: int) -> ApiError:
    """The 400 every client's context-length matcher recognises (OpenAI's sentence, the code,
    llama-server's numeric fields)."""
    return ApiError(400, f"This model's maximum context length is {max_len} tokens. However, you "
                    f"requested {num_prompt + requested} tokens ({num_prompt} in the messages, "
                    f"{requested} in the completion). Please reduce the length of the messages "
                    "or completion.", "context_length_exceeded", "messages",
                    n_prompt_tokens=num_prompt, n_ctx=max_len)


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) for pydantic's errors: the first one, named by where it is."""
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    if first.get("type") == "extra_forbidden":  # never accepted and ignored
        return f"{where}: this field is not supported by this server", where
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    return f"{where or 'body'}: {message}", where


def install(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api(request: Request, exc: ApiError):
        request_refused(request.method, request.url.path, exc.status, exc.message)
        return error_response(exc.status, exc.message, exc.code, exc.param,
                              path=request.url.path, **exc.extra)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        errors = exc.errors()
        if errors and errors[0].get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", "invalid_json",
                                  path=request.url.path)
        message, where = validation_message(errors)
        return error_response(400, message, "invalid_request", where, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), path=request.url.path)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}",
                              path=request.url.path)


class BodyLimit:
    """ASGI middleware: a body over max_bytes gets a 413 before the app reads it, whether its size
    is declared (Content-Length) or only discovered (chunked transfer, counted as it arrives)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:  # the server holds the body to this length
            if declared.isdigit() and int(declared) > self.max_bytes:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:  # read it all (at most max_bytes kept), then replay it to the app
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        replay = iter(messages)

        async def replayed():
            return next(replay, None) or await receive()

        return await self.app(scope, replayed, send)

    async def _refuse(self, scope, receive, send) -> None:
        response = error_response(413, f"the request body is over {self.max_bytes} bytes",
                                  path=scope.get("path", ""))
        await response(scope, receive, send)
