"""The playground page (`serve`'s `/`) in a real browser: headless Chromium driven over WebDriver (selenium), against
`diffgemma serve`'s app on the demo model, served by uvicorn on 127.0.0.1.

The page opens offline (nothing but this server is asked for anything), a prompt streams its reply with the canvas
drawn step by step before the reply completes, the final text is the API's for the same seed, a setting changed in
the panel takes effect, a tool call is drawn as a call with its arguments (and answered), the thought is folded
away, Stop ends a reply and Reset the conversation, a refused request shows the server's reason, an attached image
goes out as an image part, Enter sends and Shift+Enter does not, the API key is asked for once and kept in the tab's
sessionStorage, a phone-width window lays it out in one column, and the browser logs no error but those a test
causes on purpose. A screenshot after a reply is kept (its path is printed; DGTEST_ARTIFACTS=DIR keeps it
there too).

Needs Chromium and its WebDriver (Debian: apt-get install -y chromium chromium-driver) and selenium; skipped
without them.
"""

import json
import os
import shutil
import threading
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("httpx")
pytest.importorskip("selenium", reason="the browser tests drive Chromium with selenium: pip install selenium")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
if CHROMIUM is None or DRIVER is None:
    pytest.skip("the browser tests need headless Chromium and its WebDriver: apt-get install -y chromium "
                "chromium-driver", allow_module_level=True)

import httpx  # noqa: E402
import uvicorn  # noqa: E402
from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

import diffgemma  # noqa: E402
from diffgemma.server import playground  # noqa: E402
from diffgemma.server.app import create_app  # noqa: E402
from diffgemma.server.commands import listen, served_name  # noqa: E402
from diffgemma.server.worker import Worker  # noqa: E402
from diffgemma.settings import GenerationSettings  # noqa: E402

# as root in a container: no sandbox, no GPU, nothing that reaches out on its own
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--window-size=1280,860")
STORY = "Tell me a story."
WEATHER = "What's the weather in Paris?"
KEY = "sk-playground"
WAIT_S = 30


class Live:
    """create_app over `worker`, served by uvicorn on a free loopback port in a thread."""

    def __init__(self, worker, model, **app_kw):
        base = GenerationSettings.resolve(model.generation_config, env={})
        self.app = create_app(worker, model.tokenizer, served_name(model), base, **app_kw)
        self.sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            self.thread.join(0.02)
            assert self.thread.is_alive(), "the server did not start"

    def api(self, content: str, history=(), **body) -> dict:
        """The non-streamed API's reply message to a user message after `history`."""
        r = httpx.post(f"{self.url}/v1/chat/completions", timeout=60,
                       json={"messages": [*history, {"role": "user", "content": content}], **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def served():
    """(the server, the same with an API key, the same telling the page its model takes images)."""
    model = diffgemma.load()
    worker = Worker(model, slots=2, max_tokens=1024)
    live = Live(worker, model)
    keyed = Live(worker, model, api_key=KEY)
    seeing = Live(worker, model)
    with pytest.MonkeyPatch.context() as mp:  # what the model offers is read once, at the page's first info request
        mp.setattr(playground, "takes_images", lambda model: True)
        assert httpx.get(seeing.url + "/playground/info").json()["vision"] is True
    yield live, keyed, seeing
    for server in (seeing, keyed, live):
        server.close()
    worker.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    driver.logged = []  # the browser's log entries, collected as each test reads them
    driver.expected = []  # texts of the errors a test causes on purpose (the browser logs a refused request)
    yield driver
    driver.quit()


@pytest.fixture
def page(served, browser):
    """The playground on the keyless server, freshly loaded; after the test, no browser errors but those it expects."""
    live = served[0]
    open_page(browser, live.url)
    yield browser
    errors = [e for e in console(browser) if e["level"] == "SEVERE"
              and not any(text in e["message"] for text in browser.expected)]
    browser.logged, browser.expected = [], []
    assert not errors, errors


def console(driver) -> list[dict]:
    driver.logged += driver.get_log("browser")
    return driver.logged


def open_page(driver, url):
    driver.get(url + "/")
    WebDriverWait(driver, WAIT_S).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))


def setting(driver, name: str, value) -> None:
    box = driver.find_element(By.ID, f"set-{name}")
    if box.get_attribute("type") == "checkbox":
        if box.is_selected() != bool(value):
            box.click()
    else:
        box.clear()
        box.send_keys(str(value))


def send(driver, text: str) -> None:
    box = driver.find_element(By.ID, "prompt")
    box.send_keys(text)
    box.send_keys(Keys.ENTER)


def last_reply(driver):
    """Wait for the last assistant message to end -> (its element, its state)."""
    def ended(d):
        replies = d.find_elements(By.CSS_SELECTOR, ".msg.assistant")
        return replies and replies[-1].get_attribute("data-state") in ("done", "error", "stopped") and replies[-1]
    reply = WebDriverWait(driver, WAIT_S).until(ended)
    return reply, reply.get_attribute("data-state")


def reply_text(reply) -> str:
    return reply.find_element(By.CSS_SELECTOR, ".content").get_attribute("textContent")


# A MutationObserver on the canvas and the chat, installed before a prompt is sent, lists in order each frame the
# page draws (the canvas' data-frame changes) and each reply that ends (its data-state leaves "streaming").
WATCH = """
window.seen = [];
new MutationObserver((records) => {
  for (const r of records) {
    if (r.attributeName === 'data-frame') window.seen.push('frame');
    if (r.attributeName === 'data-state' && r.target.dataset.state !== 'streaming') window.seen.push('end');
  }
}).observe(document.body, {subtree: true, attributes: true, attributeFilter: ['data-frame', 'data-state']});
"""


def test_page_is_served_whole_and_asks_nothing_elsewhere(page, served):
    live = served[0]
    names = page.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert names and all(n.startswith(live.url + "/") for n in names), names
    assert page.find_element(By.ID, "model-name").text == "diffgemma-demo"
    assert page.find_element(By.ID, "set-entropy_bound").get_attribute("value") == "0.1"
    assert not page.find_element(By.ID, "attach-label").is_displayed()  # the demo model has no vision tower


def test_reply_streams_its_canvas_and_matches_the_api(page, served, tmp_path_factory):
    live = served[0]
    setting(page, "seed", 3)
    page.execute_script(WATCH)
    send(page, STORY)
    reply, how = last_reply(page)
    assert how == "done"
    seen = page.execute_script("return window.seen")
    assert seen.count("frame") >= 2 and "frame" in seen[:seen.index("end")][1:], seen  # 2+ frames before the end
    api = live.api(STORY, seed=3)
    assert reply_text(reply) == api["content"] and api["content"]
    head = page.find_element(By.ID, "canvas-head").text
    assert head.startswith("block ") and "committed" in head, head
    cells = page.find_elements(By.CSS_SELECTOR, "#canvas .cell.done")
    assert cells, "the committed block is drawn as committed"
    stats = {e.get_attribute("data-stat"): e.text for e in page.find_elements(By.CSS_SELECTOR, "#stats dd")}
    assert float(stats["tok_s"]) > 0 and float(stats["fwd_block"]) >= 1 and stats["seed"] == "3", stats
    assert int(stats["tokens"]) > 0 and stats["ttfb"].endswith(" s"), stats
    shot = tmp_path_factory.mktemp("playground") / "playground.png"
    page.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get("DGTEST_ARTIFACTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "playground.png")
    print(f"playground screenshot: {shot}")


def test_a_setting_takes_effect(page, served):
    live = served[0]
    setting(page, "seed", 3)
    setting(page, "max_new_tokens", 5)
    send(page, STORY)
    reply, _ = last_reply(page)
    short = live.api(STORY, seed=3, max_tokens=5)["content"]
    assert reply_text(reply) == short
    assert len(short) < len(live.api(STORY, seed=3)["content"])  # the setting changed the answer
    setting(page, "max_new_tokens", "")  # blank: the server's own
    setting(page, "entropy_bound", 0.01)  # a tighter bound, in the same conversation's second turn
    send(page, STORY)
    reply, _ = last_reply(page)
    history = [{"role": "user", "content": STORY}, {"role": "assistant", "content": short}]
    assert reply_text(reply) == live.api(STORY, history, seed=3, diffgemma={"entropy_bound": 0.01})["content"]
    assert page.find_element(By.ID, "canvas-head").text.endswith("entropy bound 0.01")


def test_a_refused_request_shows_the_servers_reason_and_is_not_kept(page, served):
    live = served[0]
    setting(page, "max_denoising_steps", 100000)
    page.expected.append("/v1/chat/completions - Failed to load resource: the server responded with a status of 400")
    send(page, "What is 2+2?")
    reply, how = last_reply(page)
    assert how == "error"
    assert "max_denoising_steps 100000: over this server's limit" in reply.find_element(By.CSS_SELECTOR,
                                                                                        ".error-text").text
    assert page.execute_script("return state.messages.length") == 0
    setting(page, "max_denoising_steps", 48)
    send(page, "What is 2+2?")
    reply, how = last_reply(page)
    assert how == "done" and reply_text(reply) == live.api("What is 2+2?")["content"]
    assert page.execute_script("return state.messages.map(m => m.role)") == ["user", "assistant"]


def test_a_tool_call_is_drawn_with_its_arguments_and_answered(page, served):
    setting(page, "tools", True)
    send(page, WEATHER)
    reply, how = last_reply(page)
    assert how == "done" and reply.get_attribute("data-finish") == "tool_calls"
    call = reply.find_element(By.CSS_SELECTOR, ".call")
    assert call.find_element(By.CSS_SELECTOR, ".call-name").text == "get_weather"
    args = dict(zip((e.text for e in call.find_elements(By.TAG_NAME, "dt")),
                    (json.loads(e.text) for e in call.find_elements(By.TAG_NAME, "dd"))))
    assert args == {"city": "Paris"}
    assert "get_weather" in page.find_element(By.ID, "prompt").get_attribute("placeholder")
    send(page, "17 C and sunny")  # the call's result: the model answers it
    WebDriverWait(page, WAIT_S).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2)
    _, how = last_reply(page)
    assert how == "done"
    assert page.find_element(By.CSS_SELECTOR, ".msg.tool").text.endswith("17 C and sunny")


def test_the_thought_is_folded_away(page, served):
    live = served[0]
    setting(page, "thinking", True)
    send(page, "What is 17 + 25?")
    reply, how = last_reply(page)
    api = live.api("What is 17 + 25?", chat_template_kwargs={"enable_thinking": True})
    assert how == "done" and api["reasoning_content"]
    thought = reply.find_element(By.CSS_SELECTOR, "details.thought")
    assert thought.is_displayed() and thought.get_attribute("open") is None  # there, and closed
    assert thought.find_element(By.CSS_SELECTOR, ".thought-text").get_attribute("textContent") == \
        api["reasoning_content"]
    assert reply_text(reply) == api["content"]


def test_stop_ends_the_reply_and_reset_clears_the_conversation(page, served):
    live = served[0]
    send(page, "Write a poem about the sea.")  # the demo model runs every step of every block here
    WebDriverWait(page, WAIT_S).until(lambda d: int(d.find_element(By.ID, "canvas").get_attribute("data-frame")) > 1)
    page.find_element(By.ID, "stop").click()
    _, how = last_reply(page)
    assert how == "stopped" and page.find_element(By.ID, "send").is_displayed()
    send(page, "What is 2+2?")  # the server let the stopped request go: the next one is answered
    WebDriverWait(page, WAIT_S).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) == 2)
    assert last_reply(page)[1] == "done"
    page.find_element(By.ID, "reset").click()
    assert not page.find_elements(By.CSS_SELECTOR, ".msg")
    assert page.find_element(By.ID, "canvas-head").text == "No block yet."
    send(page, "Write a poem about the sea.")  # Reset while a reply runs: it stops, and the next turn starts afresh
    WebDriverWait(page, WAIT_S).until(lambda d: int(d.find_element(By.ID, "canvas").get_attribute("data-frame")) > 1)
    page.find_element(By.ID, "reset").click()
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_element(By.ID, "send").is_displayed())
    send(page, "What is 2+2?")
    reply, _ = last_reply(page)
    assert len(page.find_elements(By.CSS_SELECTOR, ".msg")) == 2
    assert page.execute_script("return state.messages.map(m => m.role)") == ["user", "assistant"]
    assert reply_text(reply) == live.api("What is 2+2?")["content"]


def test_enter_sends_and_shift_enter_breaks_the_line(page):
    box = page.find_element(By.ID, "prompt")
    box.send_keys("What is 2+2?")
    box.send_keys(Keys.SHIFT, Keys.ENTER)
    box.send_keys("Just the number.")
    assert box.get_attribute("value") == "What is 2+2?\nJust the number."
    assert not page.find_elements(By.CSS_SELECTOR, ".msg")
    box.send_keys(Keys.ENTER)
    last_reply(page)
    assert page.find_element(By.CSS_SELECTOR, ".msg.user").text == "What is 2+2?\nJust the number."
    assert box.get_attribute("value") == ""


def test_phone_width_is_one_column(page, served):
    page.set_window_size(390, 844)
    try:
        open_page(page, served[0].url)
        send(page, "Hello!")
        last_reply(page)
        assert page.execute_script("return document.documentElement.scrollWidth <= window.innerWidth")
        for part in ("canvas", "prompt", "send", "settings-toggle"):
            assert page.find_element(By.ID, part).is_displayed(), part
        assert not page.find_element(By.ID, "settings").is_displayed()
        page.find_element(By.ID, "settings-toggle").click()
        assert page.find_element(By.ID, "set-seed").is_displayed()
        canvas, chat = (page.find_element(By.ID, i).rect for i in ("canvas", "messages"))
        assert canvas["y"] < chat["y"] and abs(canvas["x"] - chat["x"]) < 40  # stacked, not side by side
    finally:
        page.set_window_size(1280, 860)


def test_the_key_is_asked_once_and_kept_in_the_tab(browser, served):
    keyed = served[1]
    browser.get(keyed.url + "/")
    dialog = WebDriverWait(browser, WAIT_S).until(lambda d: d.find_element(By.ID, "key-dialog").is_displayed()
                                                  and d.find_element(By.ID, "key-input"))
    dialog.send_keys(KEY, Keys.ENTER)
    WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    assert browser.find_element(By.ID, "model-name").text == "diffgemma-demo"
    send(browser, "What is 2+2?")
    _, how = last_reply(browser)
    assert how == "done"
    stored = browser.execute_script("return [sessionStorage.getItem('diffgemma.apiKey'), localStorage.length]")
    assert stored == [KEY, 0]
    browser.refresh()  # the same tab: the key is not asked again
    WebDriverWait(browser, WAIT_S).until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
    assert not browser.find_element(By.ID, "key-dialog").is_displayed()
    browser.execute_script("sessionStorage.clear()")
    errors = [e for e in console(browser) if e["level"] == "SEVERE"]
    assert not errors, errors


def test_an_attached_image_goes_as_an_image_part(page, served, tmp_path):
    from PIL import Image

    seeing = served[2]
    open_page(page, seeing.url)
    assert page.find_element(By.ID, "attach-label").is_displayed()
    picture = tmp_path / "red.png"
    Image.new("RGB", (32, 24), (200, 30, 30)).save(picture)
    page.find_element(By.ID, "attach").send_keys(str(picture))
    WebDriverWait(page, WAIT_S).until(lambda d: d.find_elements(By.CSS_SELECTOR, "#attachments img"))
    page.expected.append("/v1/chat/completions - Failed to load resource: the server responded with a status of 400")
    send(page, "What is in this picture?")
    reply, how = last_reply(page)
    shown = page.find_element(By.CSS_SELECTOR, ".msg.user img").get_attribute("src")
    assert shown.startswith("data:image/png;base64,")
    assert not page.find_elements(By.CSS_SELECTOR, "#attachments img")  # sent with the message
    # the demo model has no vision tower: the server took the image part, and refuses it by name
    assert how == "error" and "cannot take images" in reply.find_element(By.CSS_SELECTOR, ".error-text").text
