"""The playground page at `/`: a chat that draws the live canvas (docs/SERVING.md, 'The playground').

Plain HTML, CSS and JavaScript shipped in this package (index.html, style.css, canvas.js, app.js), served as they are: no build
step, nothing fetched from elsewhere (the Content-Security-Policy allows this server only). The page, its
files and `/playground/info` (what the page needs before it can ask anything: whether the server wants a key, the
server's settings, the model's tools.json, whether it takes images, whether /metrics is there) are public, as
/health is; everything the page asks of the API carries the key it asks for once, kept in the browser tab's
sessionStorage.
"""

from __future__ import annotations

from importlib import resources
from importlib.util import find_spec

from fastapi import APIRouter
from fastapi.responses import Response

from ...errors import DiffgemmaError

FILES = {"/": ("index.html", "text/html; charset=utf-8"),
         "/playground/canvas.js": ("canvas.js", "text/javascript; charset=utf-8"),
         "/playground/app.js": ("app.js", "text/javascript; charset=utf-8"),
         "/playground/style.css": ("style.css", "text/css; charset=utf-8")}
INFO = "/playground/info"
PUBLIC = frozenset({"/health", INFO, *FILES})  # the paths served without the API key
# the page's resources come from this server only (data: and blob: URLs for attached images and the empty icon)
POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data: blob:; "
          "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SETTINGS = ("entropy_bound", "max_denoising_steps", "max_new_tokens", "seed", "semantics")  # the page's panel


def asset(name: str) -> str:
    """One of the page's files, as text."""
    return resources.files(__name__).joinpath(name).read_text(encoding="utf-8")


def takes_images(model) -> bool:
    from ...vision.prompt import vision_for

    try:
        vision_for(model)
    except DiffgemmaError:
        return False
    return True


def router(worker, base_settings, keyed: bool) -> APIRouter:
    """The page's routes over a running Worker and the server's GenerationSettings; keyed: the API wants a key."""
    r = APIRouter()
    for path, (name, media_type) in FILES.items():
        def page(name=name, media_type=media_type):
            return Response(asset(name), media_type=media_type,
                            headers={"Content-Security-Policy": POLICY, "Cache-Control": "no-cache"})
        r.add_api_route(path, page, methods=["GET"], include_in_schema=False)
    known: dict = {}

    @r.get(INFO, include_in_schema=False)
    def info():
        from ...loader import model_tools

        model = getattr(worker, "model", None)
        if not known:  # what the model offers does not change while it is served
            config = getattr(model, "config", None)
            known.update(vision=takes_images(model), canvas_length=getattr(config, "canvas_length", None),
                         tools=model_tools(model) if getattr(model, "path", None) is not None else None,
                         metrics=hasattr(worker, "metrics") and find_spec("prometheus_client") is not None)
        return {"key_required": keyed, **known, "settings": {k: getattr(base_settings, k) for k in SETTINGS},
                "max_tokens": getattr(worker, "max_tokens", None)}

    return r
