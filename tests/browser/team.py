"""The dashboard's working pages in a real browser (Debian's Chromium, driven by
Playwright): a new agent from the form, the workspaces list, and the team (members,
service tokens, secrets, hooks and their deliveries, the audit log). Run by
tests/dashboard.rs, which starts the server and passes: base URL, API token, screenshot
directory, the email of a person to add, and the id and title of a workspace to archive.
Prints the service tokens it made (`service-token:`, `revoked-token:`) for the Rust test
to use. Exits non-zero (with the failed expectation) when the dashboard does not behave."""

import json
import os
import re
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from playwright.sync_api import expect, sync_playwright

BASE, TOKEN, SHOTS, PERSON, ARCHIVE_ID, ARCHIVE_TITLE, BULK_ID = sys.argv[1:8]
CHROMIUM = os.environ.get("AGENTRY_CHROMIUM", "/usr/bin/chromium")
REFUSED_TITLE = "Refused by policy"
# The team page's sections, by the names the contract fixes.
SECTIONS = ["Members", "Service tokens", "Secrets", "Hooks", "Audit"]
expect.set_options(timeout=20_000)


class Receiver:
    """A hook receiver: refuses the creation of an agent titled REFUSED_TITLE, accepts
    everything else, and remembers each delivery id it got, with how often."""

    def __init__(self):
        self.lock = threading.Condition()
        self.got = []  # (event, delivery id)
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                event = self.headers["Agentry-Event"]
                with receiver.lock:
                    receiver.got.append((event, self.headers["Agentry-Delivery"]))
                    receiver.lock.notify_all()
                config = (body.get("payload") or {}).get("request", {}).get("config", {})
                if event == "agent.create.before" and config.get("title") == REFUSED_TITLE:
                    self.send_response(403)
                else:
                    self.send_response(204)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"

    def count(self, delivery):
        with self.lock:
            return sum(1 for _, d in self.got if d == delivery)

    def wait_for(self, delivery, times, within=30):
        with self.lock:
            ok = self.lock.wait_for(lambda: sum(1 for _, d in self.got if d == delivery) >= times, within)
        assert ok, f"delivery {delivery} not received {times} times: {self.got}"


def post(path, body):
    req = urllib.request.Request(
        BASE + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(req) as res:
        return res.status


def get(path):
    req = urllib.request.Request(BASE + path, headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req) as res:
        return json.load(res)


def signed_in(context, path="/"):
    page = context.new_page()
    page.goto(BASE + "/")
    page.evaluate(f"localStorage.setItem('agentry.token', {json.dumps(TOKEN)})")
    page.goto(BASE + path)
    page.on("dialog", lambda d: d.accept())
    return page


def main():
    hooks = Receiver()
    pages = []
    with sync_playwright() as p:
        try:
            return run(p, hooks, pages)
        except Exception:
            for i, page in enumerate(pages):
                if not page.is_closed():
                    page.screenshot(path=f"{SHOTS}/team-failed-{i}.png", full_page=True)
                    print(page.locator("#main").inner_text()[:3000], file=sys.stderr)
            raise


def run(p, hooks, pages):
    browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = signed_in(context)
    pages.append(page)
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    expect(page.get_by_role("heading", name="Agents")).to_be_visible()
    team_id = get("/v1/me")["default_team_id"]
    assert team_id, "the person has a default team"

    # The team page is at /teams/<id>, its sections named as the contract fixes them.
    page.get_by_role("navigation", name="Pages").get_by_role("link", name="Team").click()
    expect(page).to_have_url(f"{BASE}/teams/{team_id}")
    for part in SECTIONS:
        expect(page.get_by_role("region", name=part, exact=True)).to_be_visible()
    expect(page.locator("section.team-section")).to_have_count(len(SECTIONS))

    # A hook that waits on agent creation (and refuses one title), and one notification.
    hooks_box = page.get_by_role("region", name="Hooks", exact=True)
    hooks_box.get_by_label("Hook name").fill("policy")
    hooks_box.get_by_label("URL").fill(hooks.url)
    hooks_box.get_by_label("Signing secret").fill("whsec_dashboard_0123")
    hooks_box.get_by_label("agent.create.before").check()
    hooks_box.get_by_label("agent.create.after").check()
    hooks_box.get_by_role("button", name="Create hook").click()
    expect(hooks_box.get_by_role("table", name="Hooks")).to_contain_text("policy")
    expect(hooks_box.get_by_label("Enabled policy")).to_be_checked()

    # The new agent form: the project's default branch, the catalog's models.
    page.get_by_role("link", name="Agents").click()
    page.get_by_role("button", name="New agent", exact=True).click()
    expect(page).to_have_url(f"{BASE}/new")
    form = page.get_by_role("form", name="New agent")
    for label in ["Project", "Branch", "Provider", "Mode", "Model", "Title", "Prompt"]:
        expect(form.get_by_label(label, exact=True)).to_be_visible()
    expect(form.get_by_role("button", name="Start", exact=True)).to_be_visible()
    expect(form.get_by_label("Branch", exact=True)).to_have_value("main")
    expect(form.get_by_label("Provider", exact=True)).to_have_value("mock")
    expect(form.get_by_label("Mode", exact=True)).to_have_value("default")
    expect(form.get_by_label("Model", exact=True).locator("option")).to_have_count(3)
    form.get_by_label("Model", exact=True).select_option("mock-large")
    form.get_by_role("button", name="Refresh models").click()
    expect(form.get_by_label("Model", exact=True)).to_have_value("mock-large")
    expect(form.get_by_role("list", name="Providers not available")).to_be_visible()
    page.screenshot(path=f"{SHOTS}/new-agent.png", full_page=True)

    # A branch that does not exist: the server's words next to Branch.
    form.get_by_label("Branch", exact=True).fill("no-such-branch")
    form.get_by_label("Title", exact=True).fill("Never made")
    form.get_by_role("button", name="Start").click()
    branch_error = page.locator("#branch-error")
    expect(branch_error).to_be_visible()
    expect(branch_error).to_contain_text("no-such-branch")
    form.get_by_label("Branch", exact=True).fill("main")

    # The hook refuses: its words next to Start; the keyboard submits (Ctrl+Enter).
    form.get_by_label("Title", exact=True).fill(REFUSED_TITLE)
    form.get_by_label("Prompt", exact=True).fill("Say hi")
    form.get_by_label("Prompt", exact=True).press("Control+Enter")
    refusal = page.locator("#start-error")
    expect(refusal).to_contain_text("hook policy")
    expect(refusal).to_contain_text("failed")
    expect(branch_error).to_be_hidden()
    page.screenshot(path=f"{SHOTS}/new-agent-refused.png", full_page=True)

    # Accepted: the page goes to the agent and its reply streams in.
    form.get_by_label("Title", exact=True).fill("From the form")
    form.get_by_label("Prompt", exact=True).fill("Hello from the form")
    form.get_by_role("button", name="Start").click()
    expect(page).to_have_url(re.compile(r"/agents/agt_"))
    expect(page.get_by_role("heading", name="From the form")).to_be_visible()
    expect(page.locator(".msg.assistant").last).to_have_text("You said: Hello from the form")
    expect(page.locator(".turn-end").last).to_have_text("Turn completed")
    agent_url = page.url

    # Attention: the tab title counts the agent waiting for an answer.
    expect(page).to_have_title("agentry")
    page.get_by_label("Message").fill("/ask ship it?")
    page.get_by_role("button", name="Send").click()
    expect(page).to_have_title("(1) agentry")
    page.get_by_role("link", name="Agents").click()
    first = page.locator("tbody tr").first
    expect(first).to_contain_text("From the form")
    expect(first).to_contain_text("needs you")
    expect(page.get_by_label("Needs you first")).to_be_checked()
    page.screenshot(path=f"{SHOTS}/agents-attention.png")
    page.goto(agent_url)
    page.get_by_role("region", name="Permission: ship it?").get_by_role("button", name="Allow").click()
    expect(page).to_have_title("agentry")
    expect(page.locator(".turn-end").last).to_have_text("Turn completed")

    # 1,000 more agents (seeded by the test): the list renders fast and stays live.
    started = time.monotonic()
    page.goto(BASE + "/")
    rows = page.get_by_role("table", name="Agents").locator("tbody tr")
    expect(rows).to_have_count(1001)
    opened = time.monotonic() - started
    rendered = int(page.locator("#main").get_attribute("data-render-ms"))
    # A figure for docs/benchmarks.md, not a timed assertion: the list is only checked
    # to be whole and live.
    print(f"dashboard: 1001 agents listed in {rendered} ms ({opened * 1000:.0f} ms with the page load)")
    agent_id = agent_url.rsplit("/", 1)[1]
    assert post(f"/v1/agents/{agent_id}/messages", {"text": "/ask live?"}) == 202
    expect(rows.first).to_contain_text("needs you")
    expect(rows.first).to_contain_text("From the form")
    expect(page).to_have_title("(1) agentry")
    assert post(f"/v1/agents/{agent_id}/interrupt", {}) == 202
    expect(rows.first).not_to_contain_text("needs you")
    expect(page).to_have_title("agentry")
    # With consent, a notification when the agent asks while the page is in the
    # background (the browser's Notification and visibility stood in for).
    quiet = browser.new_context(viewport={"width": 1280, "height": 900})
    quiet.add_init_script("""
        window.told = [];
        class StandIn {
          constructor(title) {
            window.told.push(title);
            document.body.dataset.told = window.told.join(" | ");
          }
          static requestPermission() {
            StandIn.permission = "granted";
            sessionStorage.setItem("stand-in.permission", "granted");
            return Promise.resolve("granted");
          }
        }
        StandIn.permission = sessionStorage.getItem("stand-in.permission") || "default";
        window.Notification = StandIn;
        Object.defineProperty(document, "hidden", { get: () => sessionStorage.getItem("away") === "1" });
    """)
    away = signed_in(quiet, "/")
    away.get_by_role("button", name="Notify me").click()
    expect(away.get_by_role("button", name="Notifications on")).to_have_attribute("aria-pressed", "true")
    # Opened in the background: the page replays the team's history (the agent asked a
    # moment ago) and announces none of it, only what happens once it has caught up.
    away.evaluate("sessionStorage.setItem('away', '1')")
    away.reload()
    expect(away.locator("body")).to_have_attribute("data-attention", "live")
    assert away.evaluate("window.told") == [], away.evaluate("window.told")
    assert post(f"/v1/agents/{agent_id}/messages", {"text": "/ask while away?"}) == 202
    expect(away.locator("body")).to_have_attribute("data-told", "From the form: asks for permission")
    assert away.evaluate("window.told") == ["From the form: asks for permission"], away.evaluate("window.told")
    assert post(f"/v1/agents/{agent_id}/interrupt", {}) == 202
    expect(away).to_have_title("agentry")
    expect(page).to_have_title("agentry")
    quiet.close()

    page.get_by_label("Filter").fill("from the form")
    expect(page.get_by_role("table", name="Agents").locator("tbody tr:visible")).to_have_count(1)

    # Workspaces: the form's workspace with its agent; one archived from the list.
    page.get_by_role("link", name="Workspaces").click()
    expect(page).to_have_url(f"{BASE}/workspaces")
    table = page.get_by_role("table", name="Workspaces")
    row = table.locator(f'tr[data-workspace="{ARCHIVE_ID}"]')
    expect(row).to_contain_text(ARCHIVE_TITLE)
    expect(table.locator("tbody tr")).to_have_count(3)
    expect(table.locator(f'tr[data-workspace="{BULK_ID}"] td').nth(4)).to_have_text("1000")
    page.get_by_role("button", name=f"Archive {ARCHIVE_TITLE}").click()
    row = table.locator(f'tr[data-workspace="{ARCHIVE_ID}"]')
    expect(row).to_contain_text("archived")
    expect(page.get_by_role("button", name=f"Archive {ARCHIVE_TITLE}")).to_have_count(0)
    other = table.locator(f'tbody tr:not([data-workspace="{ARCHIVE_ID}"]):not([data-workspace="{BULK_ID}"])')
    expect(other.locator("td").nth(4)).to_have_text("1")
    expect(other.locator("td.changed")).to_have_text("0")
    page.screenshot(path=f"{SHOTS}/workspaces.png", full_page=True)
    # Its page lists the agent and offers a new one there.
    other.get_by_role("link").click()
    expect(page.get_by_role("list", name="Agents of this workspace")).to_contain_text("From the form")
    page.get_by_role("button", name="New agent here").click()
    expect(page.get_by_role("heading", name="New agent here")).to_be_visible()
    expect(page.get_by_label("Project", exact=True)).to_be_disabled()

    # The team: a member added and removed; the last owner is protected.
    page.get_by_role("link", name="Team").click()
    expect(page).to_have_url(f"{BASE}/teams/{team_id}")
    members = page.get_by_role("region", name="Members", exact=True)
    expect(members.get_by_role("button", name="Leave the team")).to_be_disabled()
    members.get_by_label("Member email").fill(PERSON)
    members.get_by_label("Member role").select_option("viewer")
    members.get_by_role("button", name="Add member").click()
    expect(members.get_by_label(f"Role of {PERSON}")).to_have_value("viewer")
    members.get_by_label("Member email").fill("nobody@example.com")
    members.get_by_role("button", name="Add member").click()
    expect(members.get_by_role("alert").filter(has_text="Nobody")).to_be_visible()
    members.get_by_label(f"Role of {PERSON}").select_option("member")
    expect(members.get_by_label(f"Role of {PERSON}")).to_have_value("member")
    page.screenshot(path=f"{SHOTS}/team.png", full_page=True)
    members.get_by_role("button", name=f"Remove {PERSON}").click()
    expect(members.get_by_label(f"Role of {PERSON}")).to_have_count(0)

    # Service tokens: the secret once with a copy button, then only its prefix.
    tokens = page.get_by_role("region", name="Service tokens", exact=True)
    tokens.get_by_label("Token name").fill("ci-webapp")
    tokens.get_by_label("Token role").select_option("member")
    tokens.get_by_role("button", name="Create token").click()
    fresh = tokens.get_by_role("region", name="New token", exact=True)
    expect(fresh.get_by_label("Token secret")).to_have_value(re.compile("^agt_"))
    secret = fresh.get_by_label("Token secret").input_value()
    fresh.get_by_role("button", name="Copy").click()
    expect(fresh).to_contain_text("Copied")
    listed = tokens.get_by_role("table", name="Service tokens").locator("tr", has_text="ci-webapp")
    prefix = listed.locator("code").inner_text().rstrip("…")
    assert len(prefix) >= 8 and secret.startswith(prefix) and prefix != secret, (prefix, secret)
    page.screenshot(path=f"{SHOTS}/team-token.png", full_page=True)
    fresh.get_by_role("button", name="Done").click()
    expect(tokens.get_by_role("region", name="New token")).to_have_count(0)
    tokens.get_by_label("Token name").fill("old-bot")
    tokens.get_by_role("button", name="Create token").click()
    revoked = tokens.get_by_label("Token secret").input_value()
    tokens.get_by_role("button", name="Revoke old-bot").click()
    expect(tokens.get_by_role("button", name="Revoke old-bot")).to_have_count(0)

    # A secret set: its value never shown again.
    secrets = page.get_by_role("region", name="Secrets", exact=True)
    secrets.get_by_label("Secret name").fill("DEPLOY_KEY")
    secrets.get_by_label("Secret value").fill("s3cret-value-never-shown")
    secrets.get_by_role("button", name="Set secret").click()
    expect(secrets.get_by_role("table", name="Secrets")).to_contain_text("DEPLOY_KEY")
    expect(secrets.get_by_label("Secret value")).to_have_value("")

    # A delivery redelivered: the receiver gets the same delivery again.
    hooks_box = page.get_by_role("region", name="Hooks", exact=True)
    hooks_box.get_by_role("button", name="Deliveries of policy").click()
    shown = hooks_box.get_by_role("region", name="Deliveries of policy")
    after = shown.locator("tr", has_text="agent.create.after")
    expect(after.first).to_contain_text("delivered")
    delivery = after.first.get_attribute("data-delivery")
    hooks.wait_for(delivery, 1)
    before = hooks.count(delivery)
    after.first.get_by_role("button", name="Redeliver").click()
    hooks.wait_for(delivery, before + 1)
    shown.get_by_role("button", name="Refresh deliveries").click()
    expect(shown.locator(f'tr[data-delivery="{delivery}"]')).to_contain_text("delivered")
    hooks_box.get_by_label("Enabled policy").uncheck()
    # The box stays disabled until the server has the change; a reload before that would race it.
    expect(hooks_box.get_by_label("Enabled policy")).to_be_enabled()

    # Reloaded: neither secret is anywhere on the page, the token's prefix is.
    page.reload()
    tokens = page.get_by_role("region", name="Service tokens", exact=True)
    expect(tokens.get_by_role("table", name="Service tokens")).to_contain_text(prefix)
    expect(page.get_by_role("region", name="Hooks", exact=True).get_by_label("Enabled policy")).not_to_be_checked()
    html = page.content()
    assert secret not in html and "s3cret-value-never-shown" not in html, "a secret shown again"

    # The audit log: each of those, newest first; filtered by action and by person.
    audit = page.get_by_role("region", name="Audit", exact=True).get_by_role("table", name="Audit", exact=True)
    for action in ["agent.create", "workspace.archive", "member.add", "member.role",
                   "member.remove", "token.create", "token.revoke", "secret.set",
                   "hook.create", "hook.fail"]:
        expect(audit.locator("td", has_text=re.compile(f"^{re.escape(action)}$")).first).to_be_visible()
    expect(audit.locator("tbody tr").first.locator("td").nth(2)).to_have_text("hook.update")
    page.get_by_label("Action", exact=True).select_option("member.add")
    expect(audit.locator("tbody tr")).to_have_count(1)
    expect(audit.locator("tbody tr").first).to_contain_text("member.add")
    page.get_by_label("Action", exact=True).select_option("")
    page.get_by_label("Person", exact=True).select_option(label="ci-webapp (service token)")
    expect(audit).to_contain_text("No entries.")
    page.get_by_label("Person", exact=True).select_option(index=1)
    expect(audit.locator("tbody tr").first.locator("td").nth(2)).to_have_text("hook.update")
    page.get_by_label("Person", exact=True).select_option("")
    page.get_by_role("region", name="Audit", exact=True).screenshot(path=f"{SHOTS}/audit.png")

    # The same pages on a phone.
    phone = browser.new_context(viewport={"width": 390, "height": 844})
    for name, path, ready in [
        ("home-phone", "/", "Agents"),
        ("new-agent-phone", "/new", "New agent"),
        ("workspaces-phone", "/workspaces?archived=1", "Workspaces"),
        ("team-phone", f"/teams/{team_id}", "Audit"),
    ]:
        small = signed_in(phone, path)
        expect(small.get_by_role("heading", name=ready, exact=True)).to_be_visible()
        if name == "team-phone":
            for part in SECTIONS:
                expect(small.get_by_role("region", name=part, exact=True).get_by_role("heading", name=part, exact=True)).to_be_visible()
        expect(small.locator("td.changed", has_text="…")).to_have_count(0)
        small.screenshot(path=f"{SHOTS}/{name}.png", full_page=name != "home-phone")
        small.close()

    # The addresses pages had before keep leading to them, under their new address.
    for old, new, ready in [
        ("/?view=team", f"/teams/{team_id}", "Audit"),
        (f"/?view=usage&team={team_id}", f"/teams/{team_id}/usage", re.compile("^Usage of ")),
        ("/?view=workspaces&archived=1", "/workspaces?archived=1", "Workspaces"),
        ("/?view=new", "/new", "New agent"),
    ]:
        small = signed_in(phone, old)
        expect(small.get_by_role("heading", name=ready, exact=True)).to_be_visible()
        expect(small).to_have_url(BASE + new)
        small.close()
    # Another team's page, or one that is not, answers as not found.
    small = signed_in(phone, "/teams/tea_nosuchteam")
    expect(small.get_by_role("heading", name="Not found", exact=True)).to_be_visible()
    small.close()

    assert not errors, f"script errors: {errors}"
    browser.close()
    print(f"service-token: {secret}")
    print(f"revoked-token: {revoked}")


if __name__ == "__main__":
    main()
    print("dashboard team: ok")
