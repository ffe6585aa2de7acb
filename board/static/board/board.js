/* Taskboard in the browser: the live board ("/") and a task's page ("/tasks/<id>/").
 *
 * The server draws each page from one database snapshot and embeds, as JSON (#board-state),
 * the tasks it drew, the id to resume the event stream from, and the ids of the events the
 * stream will deliver although the page already shows them. This script opens the stream
 * (EventSource on /api/v1/stream/?lastEventId=<resume id>) and applies every other event,
 * in order, exactly once: no reload and no polling.
 *
 * A holder's changes go through the REST API with the session cookie and the CSRF token. A
 * person's claim keeps its lease_token in sessionStorage (one tab holds one lease); the
 * open page heartbeats at a third of the lease and says so when the lease is lost. Comments
 * and pausing a queue are plain forms that post to the page's own views.
 *
 * The board's queues and agents panels are no events of their own: the page fetches them
 * again from the API (queues/, agents/) shortly after events arrive, and every so often.
 *
 * User text only ever reaches the page through textContent (the h() helper below).
 */
(() => {
  "use strict";

  const stateElement = document.getElementById("board-state");
  if (!stateElement) return;
  const STATE = JSON.parse(stateElement.textContent);
  const ME = STATE.user;
  // The server's clock minus ours, so countdowns agree with the server's lease deadlines.
  // Each reading is a lower bound: the server read its clock before this page's response
  // began to arrive (not when this script ran, which can be a second later), and wrote
  // each event before the stream brought it. The largest reading is the closest.
  const [navigation] = performance.getEntriesByType("navigation");
  const now = Date.now();
  let arrived = navigation?.responseStart
    ? performance.timeOrigin + navigation.responseStart
    : now;
  // The performance clock can drift from the wall clock (a machine that slept): distrust
  // a reading from the future or from long ago.
  if (arrived > now || arrived < now - 60000) arrived = now;
  let skew = Date.parse(STATE.now) - arrived;
  const serverNow = () => Date.now() + skew;
  function readServerClock(iso) {
    const reading = Date.parse(iso) - Date.now();
    if (reading > skew) skew = reading;
  }

  // -- DOM -------------------------------------------------------------------------------

  /** Build an element; strings become text nodes, never markup. */
  function h(tag, props = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props)) {
      if (value === null || value === undefined || value === false) continue;
      if (key === "class") node.className = value;
      else if (key === "dataset") Object.assign(node.dataset, value);
      else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : String(child));
    }
    return node;
  }

  const label = (status) => String(status).replace(/_/g, " ");

  function truncate(text, length) {
    return text.length > length ? `${text.slice(0, length - 1)}…` : text;
  }

  function sortedKeys(value) {
    if (Array.isArray(value)) return value.map(sortedKeys);
    if (value && typeof value === "object") {
      return Object.fromEntries(
        Object.keys(value).sort().map((key) => [key, sortedKeys(value[key])]),
      );
    }
    return value;
  }

  const prettyJSON = (value) => JSON.stringify(sortedKeys(value), null, 2);

  // -- Time ------------------------------------------------------------------------------

  function countdown(ms) {
    const total = Math.ceil(ms / 1000);
    const hours = Math.floor(total / 3600);
    const minutes = Math.floor((total % 3600) / 60);
    const seconds = total % 60;
    if (hours) return `${hours}h ${String(minutes).padStart(2, "0")}m left`;
    return `${minutes}:${String(seconds).padStart(2, "0")} left`;
  }

  function relative(iso) {
    const seconds = (serverNow() - Date.parse(iso)) / 1000;
    if (seconds < 45) return "just now";
    if (seconds < 90) return "1 min ago";
    if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
    if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
    return new Date(iso).toLocaleDateString(undefined, { month: "short", day: "numeric" });
  }

  const absolute = (iso) =>
    new Date(iso).toLocaleString(undefined, {
      month: "short", day: "numeric", hour: "2-digit", minute: "2-digit", second: "2-digit",
    });

  /** A <time> for ``iso``; refreshTimes() words it for where it is placed. */
  function timeElement(iso) {
    return h("time", { datetime: iso, title: absolute(iso) }, relative(iso));
  }

  // A time as the database's JSON writes it: 2026-03-01T12:00:00.123456+00:00.
  const TIMESTAMP = /^\d{4}-\d\d-\d\dT\d\d:\d\d(:\d\d(\.\d+)?)?(Z|[+-]\d\d:\d\d)$/;

  /** Rewrite every <time> in the reader's time zone: "3 min ago" on cards and in the
   * timeline's headings, the date and time elsewhere. */
  function refreshTimes(root = document) {
    for (const node of root.querySelectorAll("time[datetime]")) {
      const iso = node.getAttribute("datetime");
      if (!iso || Number.isNaN(Date.parse(iso))) continue;
      node.title = absolute(iso);
      if (node.hasAttribute("data-clock")) node.textContent = clock(iso, node.closest("[data-seconds]"));
      else if (node.closest(".card-meta, .event-head, .glance-table")) node.textContent = relative(iso);
      else node.textContent = absolute(iso);
    }
  }

  /** The time of day, as a run of heartbeats shows its first and last ("10:02–10:06"). */
  const clock = (iso, seconds) =>
    new Date(iso).toLocaleTimeString(undefined, {
      hour: "2-digit", minute: "2-digit", second: seconds ? "2-digit" : undefined,
    });

  /** Update lease countdowns; a lease past its deadline shows "stalled". */
  function refreshLeases(root = document) {
    for (const node of root.querySelectorAll(".lease[data-until]")) {
      const until = Date.parse(node.dataset.until);
      if (Number.isNaN(until)) continue;
      const left = until - serverNow();
      const stalled = left <= 0;
      node.textContent = stalled ? "stalled" : countdown(left);
      node.classList.toggle("is-stalled", stalled);
      node.closest(".card, .holder-panel")?.classList.toggle("stalled", stalled);
      const badge = document.querySelector('[data-field="stalled"]');
      if (badge && node.closest(".holder-panel")) badge.hidden = !stalled;
    }
    for (const node of root.querySelectorAll(".deadline[data-deadline]")) {
      const deadline = Date.parse(node.dataset.deadline);
      if (Number.isNaN(deadline)) continue;
      const left = deadline - serverNow();
      node.textContent = left <= 0 ? "attempt deadline passed" : `attempt: ${countdown(left)}`;
      node.classList.toggle("is-passed", left <= 0);
    }
  }

  /** When the current attempt on ``task`` must end, as an ISO time, or null. */
  function deadlineOf(task) {
    if (task.status !== "in_progress") return null;
    if (!task.attempt_started_at || !task.max_attempt_seconds) return null;
    return new Date(Date.parse(task.attempt_started_at) + task.max_attempt_seconds * 1000)
      .toISOString();
  }

  // -- Notices ---------------------------------------------------------------------------

  const notices = document.getElementById("notices");

  function notify(text, { kind = "info", sticky = false } = {}) {
    const close = h("button", { type: "button", "aria-label": "Dismiss" }, "✕");
    const notice = h("div", { class: `notice ${kind}`, role: kind === "error" ? "alert" : "status" },
      h("span", {}, text), close);
    close.addEventListener("click", () => notice.remove());
    notices?.append(notice);
    if (!sticky) setTimeout(() => notice.remove(), 6000);
    return notice;
  }

  // The messages of a form the server answered (a pause, a resume): dismissed the same way.
  for (const notice of document.querySelectorAll("[data-server-notice]")) {
    const close = h("button", { type: "button", "aria-label": "Dismiss" }, "✕");
    close.addEventListener("click", () => notice.remove());
    notice.append(close);
    setTimeout(() => notice.remove(), 6000);
  }

  // -- The REST API ----------------------------------------------------------------------

  function csrfToken() {
    const match = document.cookie.match(/(?:^|;\s*)csrftoken=([^;]+)/);
    return match ? decodeURIComponent(match[1]) : "";
  }

  /** Call /api/v1/<path>; resolve to {ok, status, data} (data: the JSON body or null). */
  const api = (method, path, body) => request(method, `/api/v1/${path}`, body);

  /** Call ``url`` (the API, or a page's JSON); resolve as api() does. */
  async function request(method, url, body) {
    const headers = { Accept: "application/json" };
    const options = { method, headers, credentials: "same-origin" };
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      options.body = JSON.stringify(body);
    }
    if (method !== "GET") headers["X-CSRFToken"] = csrfToken();
    let response;
    try {
      response = await fetch(url, options);
    } catch {
      return { ok: false, status: 0, data: { detail: "The server could not be reached." } };
    }
    let data = null;
    try {
      data = await response.json();
    } catch {
      data = null;
    }
    if (response.status === 401) sessionEnded();
    return { ok: response.ok, status: response.status, data };
  }

  // -- A session that ended --------------------------------------------------------------
  // A page left open after its user logged out (or the session expired) would go on asking
  // for the stream and the panels, each answered 401, for as long as it stays open: the
  // first 401 stops both and says so.

  let signedOut = false;
  const onSessionEnd = []; // what stops then: the stream, the leases' heartbeats

  function sessionEnded() {
    if (signedOut) return;
    signedOut = true;
    for (const stop of onSessionEnd) stop();
    const next = encodeURIComponent(location.pathname + location.search);
    const notice = notify("You are signed out: this page no longer follows the board. ", {
      kind: "error",
      sticky: true,
    });
    notice.firstChild.append(h("a", { href: `/accounts/login/?next=${next}` }, "Log in again"));
    const indicator = document.querySelector(".live");
    if (indicator) {
      indicator.dataset.stream = "offline";
      indicator.textContent = "Signed out";
    }
  }

  function errorText(result, fallback) {
    const data = result.data || {};
    if (data.fields) {
      return Object.entries(data.fields)
        .map(([field, messages]) => `${field}: ${[].concat(messages).join(" ")}`)
        .join("; ");
    }
    return data.detail || fallback;
  }

  async function fetchTask(id) {
    const result = await api("GET", `tasks/${id}/`);
    return result.ok ? result.data : null;
  }

  /** Read task ``id`` and hand it to ``use``, once at a time per task: asked again while a
   * read is on its way, it reads once more after it. A stream of heartbeats of a task
   * whose progress is too large to stream costs one read at a time, not one per event. */
  const rereads = new Map();
  function reread(id, use) {
    const state = rereads.get(id);
    if (state) {
      state.again = true;
      state.use = use;
      return;
    }
    const mine = { again: false, use };
    rereads.set(id, mine);
    (async () => {
      try {
        do {
          mine.again = false;
          const task = await fetchTask(id);
          if (task) mine.use(task);
        } while (mine.again);
      } finally {
        rereads.delete(id);
      }
    })().catch((error) => console.error("taskboard:", error));
  }

  // -- Leases held by this tab -----------------------------------------------------------

  /** A person's leases: the token per task in sessionStorage, a heartbeat timer each. */
  const Leases = {
    prefix: "taskboard.lease.",
    timers: new Map(),
    lost: new Set(), // tasks whose lease this tab lost
    notices: new Map(), // the sticky "you lost the lease" notice of each of them
    settling: new Set(), // tasks this tab just completed, failed or released
    onChange: () => {},

    get(id) {
      try {
        return JSON.parse(sessionStorage.getItem(this.prefix + id));
      } catch {
        return null;
      }
    },

    ids() {
      const ids = [];
      for (let i = 0; i < sessionStorage.length; i++) {
        const key = sessionStorage.key(i);
        if (key && key.startsWith(this.prefix)) ids.push(Number(key.slice(this.prefix.length)));
      }
      return ids;
    },

    hold(id, token, seconds) {
      sessionStorage.setItem(this.prefix + id, JSON.stringify({ token, seconds }));
      this.lost.delete(id);
      this.settling.delete(id);
      this.keepAlive(id);
      this.onChange(id);
    },

    forget(id) {
      sessionStorage.removeItem(this.prefix + id);
      clearInterval(this.timers.get(id));
      this.timers.delete(id);
    },

    /** Heartbeat every third of the lease (and at once when ``now``). */
    keepAlive(id, now = false) {
      const lease = this.get(id);
      if (!lease || this.timers.has(id) || signedOut) return;
      const every = Math.max(1000, (lease.seconds * 1000) / 3);
      this.timers.set(id, setInterval(() => this.beat(id), every));
      if (now) this.beat(id);
    },

    async beat(id) {
      const lease = this.get(id);
      if (!lease) return this.forget(id);
      const result = await api("POST", `tasks/${id}/heartbeat/`, { lease_token: lease.token });
      if (result.status === 409 || result.status === 404) {
        this.lose(id, errorText(result, "The lease is gone."));
      }
      // Other failures (network, 503): keep trying; a lease that runs out meanwhile
      // answers 409 on the next beat.
    },

    lose(id, detail) {
      if (!this.get(id)) return;
      this.forget(id);
      this.lost.add(id);
      this.notices.get(id)?.remove();
      this.notices.set(id, notify(`You lost the lease on #${id}: stop working on it. ${detail}`, {
        kind: "error", sticky: true,
      }));
      this.onChange(id);
    },

    /** The task is finished (done or cancelled): nobody works on it any more, so the
     * warning about its lost lease is stale. */
    finished(id) {
      this.notices.get(id)?.remove();
      this.notices.delete(id);
      this.lost.delete(id);
    },

    /** Check a task's event against this tab's lease: a new holder or an expiry means a
     * beat now, which the server answers with 409 if the lease is really gone. */
    check(task, event) {
      if (FINISHED.has(task.status)) this.finished(task.id);
      if (!this.get(task.id)) return;
      if (task.status === "in_progress" && task.leased_by === ME) return;
      if (event.actor === ME && event.type !== "claimed") this.forget(task.id);
      else this.beat(task.id);
    },
  };
  // Heartbeats answered 401 keep no lease: stop them with the session (the lease runs out,
  // as when the tab closes).
  onSessionEnd.push(() => {
    for (const timer of Leases.timers.values()) clearInterval(timer);
    Leases.timers.clear();
  });

  const PAST = { complete: "Completed", fail: "Failed", release: "Released" };
  const FINISHED = new Set(["done", "cancelled"]);

  /** Complete, fail or release a task this tab holds. */
  async function act(id, verb, body, box) {
    const lease = Leases.get(id);
    if (!lease) {
      Leases.lost.add(id);
      Leases.onChange(id);
      return;
    }
    for (const control of box.querySelectorAll("button, input, textarea")) control.disabled = true;
    const result = await api("POST", `tasks/${id}/${verb}/`, { lease_token: lease.token, ...body });
    if (result.ok) {
      Leases.forget(id);
      Leases.settling.add(id);
      notify(`${PAST[verb]} #${id}.`);
      Leases.onChange(id);
    } else if (result.status === 409) {
      Leases.lose(id, errorText(result, "The lease is gone."));
    } else {
      for (const control of box.querySelectorAll("button, input, textarea")) control.disabled = false;
      notify(errorText(result, `Could not ${verb} #${id}.`), { kind: "error" });
    }
  }

  /** The buttons of a task this tab holds: complete, fail (with an error text), release. */
  function holderActions(id, { withResult = false } = {}) {
    const box = h("div", { class: "card-actions", dataset: { actionsFor: id } });

    function replaceForm(form) {
      box.querySelector("form")?.remove();
      box.append(form);
      form.querySelector("input, textarea")?.focus();
    }

    function showFail() {
      const input = h("input", {
        class: "inline-input", name: "error", placeholder: "What went wrong?",
        maxlength: 10000, "aria-label": "Error",
      });
      const form = h("form", { class: "fail-form" },
        input,
        h("button", { type: "submit", class: "button small danger" }, "Fail task"),
        h("button", { type: "button", class: "button small", onclick: () => form.remove() }, "Cancel"));
      form.addEventListener("submit", (submit) => {
        submit.preventDefault();
        const error = input.value.trim();
        if (!error) return input.focus();
        act(id, "fail", { error }, box);
      });
      replaceForm(form);
    }

    function showComplete() {
      const text = h("textarea", {
        class: "mono", name: "result", rows: 3, spellcheck: "false", placeholder: "{\"ok\": true}",
      });
      const problem = h("p", { class: "form-error", hidden: true });
      const form = h("form", { class: "result-form" },
        h("label", { class: "field" }, h("span", {}, "Result (JSON, optional)"), text),
        problem,
        h("div", { class: "card-actions" },
          h("button", { type: "submit", class: "button small primary" }, "Complete task"),
          h("button", { type: "button", class: "button small", onclick: () => form.remove() }, "Cancel")));
      form.addEventListener("submit", (submit) => {
        submit.preventDefault();
        let value = null;
        if (text.value.trim()) {
          try {
            value = JSON.parse(text.value);
          } catch {
            problem.textContent = "The result is not valid JSON.";
            problem.hidden = false;
            return;
          }
        }
        act(id, "complete", { result: value }, box);
      });
      replaceForm(form);
    }

    box.append(
      h("button", {
        type: "button", class: "button small primary",
        onclick: () => (withResult ? showComplete() : act(id, "complete", {}, box)),
      }, withResult ? "Complete…" : "Complete"),
      h("button", { type: "button", class: "button small danger", onclick: showFail }, "Fail…"),
      h("button", { type: "button", class: "button small", onclick: () => act(id, "release", {}, box) }, "Release"),
    );
    return box;
  }

  /** What a card or the task page shows about the viewer's own hold on a task. */
  function holdingOf(task, options) {
    if (task.status !== "in_progress" || task.leased_by !== ME) return null;
    if (Leases.get(task.id)) return holderActions(task.id, options);
    if (Leases.settling.has(task.id)) return h("p", { class: "card-note" }, "Updating…");
    if (Leases.lost.has(task.id)) {
      return h("p", { class: "card-note lost" }, "Lease lost: stop working on it.");
    }
    return h("p", { class: "card-note" }, "Held by you in another tab or session.");
  }

  // -- Applying events -------------------------------------------------------------------

  /** The task an event carries, without the values it left out for their size (null,
   * and named in ``elided``): the page keeps what it has of those, and reads the task
   * (``reread``) where it shows one. Null when the event carries no task. */
  function sentTask(event) {
    if (!event.task) return null;
    const { elided = [], ...task } = event.task;
    for (const name of elided) delete task[name];
    return { task, elided };
  }

  /** Take the task as the server sent it after ``event``: the page never works out what
   * a transition does. An event sent without its task (a later event of the task has
   * committed, and follows with it) changes nothing. Return the names of the values the
   * event left out. */
  function applyToTask(task, event) {
    const sent = sentTask(event);
    if (sent) Object.assign(task, sent.task);
    return sent?.elided ?? [];
  }

  // A card shows the start of the latest progress, as board_extras.progress_text does.
  const PROGRESS_TEXT_LIMIT = 120;

  function progressText(progress) {
    if (progress === null || progress === undefined) return null;
    const text = typeof progress === "string" ? progress : JSON.stringify(sortedKeys(progress));
    return truncate(text, PROGRESS_TEXT_LIMIT);
  }

  /** A link to a related task with its status: "#12 (in progress)". */
  function taskLink(info) {
    if (!info || info.hidden) {
      return h("span", { class: "blocker" }, `#${info?.id ?? "?"}`);
    }
    return [
      h("a", { class: "blocker", href: `/tasks/${info.id}/` }, `#${info.id}`),
      info.status ? [" ", h("span", { class: `badge badge-${info.status}` }, label(info.status))] : null,
    ];
  }

  /** What the page knows of tasks it does not draw in full (dependencies, related tasks):
   * id -> {id, title, status, blocked} or {id, hidden: true} for another queue's. Events
   * keep their status current; unknown ones are fetched once. */
  const Known = {
    tasks: new Map(),
    set(info) {
      this.tasks.set(info.id, { ...this.tasks.get(info.id), ...info });
    },
    get(id) {
      return this.tasks.get(id);
    },
    /** Follow ``event`` on a task the page knows of; return whether it knew it. */
    follow(event) {
      const info = this.tasks.get(event.task_id);
      if (!info || info.hidden) return false;
      if (event.task) Object.assign(info, { status: event.task.status, blocked: event.task.blocked });
      return true;
    },
    /** Fetch what the page does not know yet of ``ids`` (a 404: another queue's). */
    async learn(ids) {
      const missing = ids.filter((id) => !this.tasks.has(id));
      await Promise.all(missing.map(async (id) => {
        const task = await fetchTask(id);
        this.set(task
          ? { id, title: task.title, status: task.status, blocked: task.blocked }
          : { id, hidden: true });
      }));
    },
  };

  /** Open the stream and hand each event to ``onEvent``, in order. */
  function connect(onEvent) {
    const indicator = document.querySelector(".live");
    let last = String(STATE.resume_id);
    let delay = 1000;

    function show(state, text) {
      if (!indicator) return;
      indicator.dataset.stream = state;
      indicator.textContent = text;
    }

    let source = null;
    onSessionEnd.push(() => source?.close());

    function open() {
      if (signedOut) return;
      // The query names where to resume; on its own reconnects EventSource sends the last
      // id it received as Last-Event-ID, which the server prefers.
      source = new EventSource(`/api/v1/stream/?lastEventId=${encodeURIComponent(last)}`);
      source.addEventListener("open", () => {
        delay = 1000;
        show("live", "Live");
      });
      source.addEventListener("task_event", (message) => {
        if (message.lastEventId) last = message.lastEventId;
        let event;
        try {
          event = JSON.parse(message.data);
        } catch {
          return;
        }
        readServerClock(event.created_at);
        onEvent(event);
      });
      source.addEventListener("error", async () => {
        if (signedOut) {
          source.close();
        } else if (source.readyState === EventSource.CLOSED) {
          // Refused (a 503, or the session ended): EventSource gives up. Ask the API which
          // (a 401 there ends the page's session: sessionEnded); try again later unless so.
          show("offline", "Offline, retrying");
          await request("GET", "/panels/");
          if (signedOut) return;
          setTimeout(open, delay);
          delay = Math.min(delay * 2, 30000);
        } else {
          show("reconnecting", "Reconnecting…");
        }
      });
    }

    open();
  }

  /** The ids of the events a page has applied, or that the server drew into it: an event
   * delivered again changes nothing. The oldest ids are forgotten past a bound (the stream
   * itself sends nothing twice; only the page's first events may repeat what it shows). */
  function eventIds(initial) {
    const ids = new Set(initial);
    return {
      has: (id) => ids.has(id),
      add(id) {
        ids.add(id);
        if (ids.size <= 50000) return;
        let surplus = ids.size - 40000;
        for (const old of ids) {
          if (surplus-- <= 0) break;
          ids.delete(old);
        }
      },
    };
  }

  /** Apply events one at a time, in arrival order, even when one waits for a fetch. */
  function serially(apply) {
    let chain = Promise.resolve();
    return (event) => {
      chain = chain.then(() => apply(event)).catch((error) => console.error("taskboard:", error));
    };
  }

  // -- The board -------------------------------------------------------------------------

  const COLUMN_OF = {
    pending: "pending", in_progress: "in_progress", escalated: "escalated",
    done: "finished", cancelled: "finished",
  };
  const time = (iso) => Date.parse(iso) || 0;
  const claimOrder = (a, b) =>
    b.priority - a.priority || time(a.created_at) - time(b.created_at) || a.id - b.id;
  const ORDER = {
    pending: claimOrder,
    in_progress: claimOrder,
    escalated: (a, b) => time(a.updated_at) - time(b.updated_at) || a.id - b.id,
    finished: (a, b) => time(b.updated_at) - time(a.updated_at) || b.id - a.id,
  };

  function renderCard(task) {
    const url = `/tasks/${task.id}/`;
    const inProgress = task.status === "in_progress";
    const finished = task.status === "done" || task.status === "cancelled";
    const mine = inProgress && task.leased_by === ME && Boolean(Leases.get(task.id));
    const due = task.status === "pending" && task.run_after && time(task.run_after) > serverNow();
    const deadline = deadlineOf(task);
    const card = h("article", {
      class: `card status-${task.status}${mine ? " mine" : ""}${task.blocked ? " blocked" : ""}`,
      dataset: { taskId: task.id },
    },
      h("div", { class: "card-top" },
        h("a", { class: "card-id", href: url }, `#${task.id}`),
        h("span", { class: "chip chip-queue", title: "Queue" }, task.queue),
        task.priority ? h("span", { class: "chip chip-priority", title: "Priority" }, `P${task.priority}`) : null,
        task.failure_count
          ? h("span", { class: "chip chip-strikes", title: "Failures since the last requeue" },
            `${task.failure_count}/${task.max_failures ?? "?"} strikes`)
          : null,
        task.parent_id
          ? h("a", { class: "chip chip-parent", href: `/tasks/${task.parent_id}/`, title: `A subtask of #${task.parent_id}` },
            `sub of #${task.parent_id}`)
          : null,
        task.blocked
          ? h("span", { class: "chip chip-blocked", title: "Not claimable until its dependencies are done" }, "blocked")
          : null,
        task.comments
          ? h("span", { class: "chip chip-comments", title: "Comments" },
            `${task.comments} comment${task.comments === 1 ? "" : "s"}`)
          : null,
        finished ? h("span", { class: `badge badge-${task.status}` }, label(task.status)) : null),
      h("a", { class: "card-title", href: url }, task.title),
      inProgress
        ? h("div", { class: "card-lease" },
          h("span", { class: "holder", title: "Holder" }, task.leased_by),
          h("span", { class: "lease", dataset: { until: task.leased_until } }))
        : null,
      inProgress && task.progress_text
        ? h("p", { class: "card-progress", title: "Latest progress" }, task.progress_text)
        : null,
      deadline
        ? h("p", { class: "card-deadline" }, h("span", { class: "deadline", dataset: { deadline } }))
        : null,
      task.blocked ? blockersLine(task) : null,
      task.last_error && task.status !== "done"
        ? h("p", { class: "card-error" }, truncate(task.last_error, 160))
        : null,
      inProgress
        ? null
        : h("p", { class: "card-meta" },
          task.status === "pending" ? `by ${task.created_by} · ` : null,
          timeElement(task.updated_at),
          due ? ` · retry after ${absolute(task.run_after)}` : null),
      holdingOf(task));
    refreshLeases(card);
    return card;
  }

  /** "Waiting for #3 (in progress), #5 (cancelled)": the dependencies that are not done. */
  function blockersLine(task) {
    const open = (task.depends_on ?? []).filter((id) => Known.get(id)?.status !== "done");
    const links = open.map((id, index) => [index ? ", " : null, taskLink(Known.get(id) ?? { id })]);
    return h("p", { class: "card-blockers", dataset: { blockers: "" } },
      "Waiting for ", links.length ? links : "its dependencies");
  }

  // -- The queues and agents panels ------------------------------------------------------

  const QUEUE_COUNTS = ["pending", "blocked", "in_progress", "escalated", "done", "cancelled"];

  function queueRow(queue) {
    const counts = queue.counts || {};
    const here = `${location.pathname}${location.search}`;
    const verb = queue.paused ? "resume" : "pause";
    return h("tr", { class: queue.paused ? "paused" : null, dataset: { queue: queue.name } },
      h("th", { scope: "row" },
        h("a", { href: `/?queue=${encodeURIComponent(queue.name)}` }, queue.name),
        queue.paused
          ? [" ", h("span", {
            class: "badge badge-paused",
            title: queue.changed_by ? `by ${queue.changed_by}${queue.note ? `: ${queue.note}` : ""}` : null,
          }, "paused")]
          : null),
      QUEUE_COUNTS.map((key) => h("td", { class: "n", dataset: { n: key } }, counts[key] ?? 0)),
      h("td", { class: "when" }, queue.oldest_pending_at ? timeElement(queue.oldest_pending_at) : "—"),
      STATE.can_pause
        ? h("td", { class: "pause-cell" },
          h("form", { class: "pause-form", method: "post", action: `/queues/${encodeURIComponent(queue.name)}/${verb}/` },
            h("input", { type: "hidden", name: "csrfmiddlewaretoken", value: csrfToken() }),
            h("input", { type: "hidden", name: "next", value: here }),
            h("input", {
              class: "inline-input", name: "note", maxlength: 1000, placeholder: "Note",
              "aria-label": `Note on ${queue.name}`,
            }),
            h("button", {
              type: "submit", class: `button small${queue.paused ? "" : " danger"}`,
              "aria-label": `${queue.paused ? "Resume" : "Pause"} ${queue.name}`,
            },
              queue.paused ? "Resume" : "Pause")))
        : null);
  }

  function agentRow(agent) {
    const holding = agent.holding ?? [];
    return h("tr", { dataset: { agent: agent.name } },
      h("th", { scope: "row" }, agent.name),
      h("td", { class: "holding" }, holding.length
        ? holding.map((id, index) => [index ? " " : null, h("a", { href: `/tasks/${id}/` }, `#${id}`)])
        : h("span", { class: "muted" }, "nothing")),
      h("td", { class: "when" }, agent.last_seen_at ? timeElement(agent.last_seen_at) : "—"),
      h("td", { class: "n", title: "completed, failed and expired in the last 24 hours" },
        `${agent.completed_24h ?? 0} · ${agent.failed_24h ?? 0} · ${agent.expired_24h ?? 0}`));
  }

  /** Those holding tasks first, then the most recently seen, as the server orders them. */
  function agentOrder(a, b) {
    const holds = (agent) => ((agent.holding ?? []).length ? 0 : 1);
    return holds(a) - holds(b)
      || (time(b.last_seen_at) - time(a.last_seen_at))
      || (a.name < b.name ? -1 : a.name > b.name ? 1 : 0);
  }

  /** Draw the panels from ``STATE``, then fetch them again (/panels/, as bounded as the
   * page) soon after events; hand each reading's counts to ``onCounts``. */
  function glancePanels(onCounts = () => {}) {
    const queuesBody = document.querySelector("[data-queues]");
    const agentsBody = document.querySelector("[data-agents]");
    if (!queuesBody || !agentsBody) return () => {};

    function drawQueues(queues, inAll) {
      const rows = new Map([...queuesBody.children].map((row) => [row.dataset.queue, row]));
      // In the server's order: paused ones first, then the busiest.
      const names = new Set(queues.map((queue) => queue.name));
      for (const [name, row] of rows) if (!names.has(name)) row.remove();
      queues.forEach((queue, index) => {
        const fresh = queueRow(queue);
        let row = rows.get(queue.name);
        if (row && row.classList.contains("paused") === Boolean(queue.paused)) {
          // The same state: take the new numbers and times, and keep the rest (a note
          // someone is typing in the form, and its focus; who paused it, which the API
          // does not repeat).
          [...fresh.children].forEach((cell, at) => {
            if (cell.matches(".n, .when")) row.children[at].replaceWith(cell);
          });
        } else {
          row?.remove();
          row = fresh;
        }
        if (queuesBody.children[index] !== row) {
          queuesBody.insertBefore(row, queuesBody.children[index] ?? null);
        }
      });
      document.querySelector("[data-queues-empty]").hidden = queues.length > 0;
      const more = document.querySelector("[data-queues-more]");
      if (more) {
        more.hidden = inAll <= queues.length;
        more.querySelector("[data-queues-more-text]").textContent =
          `Showing ${queues.length} of ${inAll} queues: paused ones, then the busiest.`;
      }
    }

    function drawAgents(agents) {
      const sorted = [...agents].sort(agentOrder).slice(0, STATE.agents_limit ?? 50);
      agentsBody.replaceChildren(...sorted.map(agentRow));
      document.querySelector("[data-agents-empty]").hidden = agents.length > 0;
    }

    drawQueues(STATE.queues ?? [], STATE.queues_in_all ?? 0);
    drawAgents(STATE.agents ?? []);

    let timer = null;
    let last = 0;
    async function refresh() {
      timer = null;
      if (signedOut) return;
      last = Date.now();
      const query = STATE.queue ? `?queue=${encodeURIComponent(STATE.queue)}` : "";
      const panels = await request("GET", `/panels/${query}`);
      if (!panels.ok) return;
      drawQueues(panels.data.queues, panels.data.queues_in_all);
      drawAgents(panels.data.agents);
      onCounts(panels.data.counts);
      refreshTimes(queuesBody.closest(".glance"));
    }

    /** Fetch the panels again within two seconds (once, however many events come). */
    function soon() {
      if (timer) return;
      timer = setTimeout(refresh, Math.max(0, 2000 - (Date.now() - last)));
    }

    // A pause or resume is no task event, and last seen moves on: look again now and then.
    setInterval(soon, 15000);
    return soon;
  }

  /** Keep of a task's data what its card shows: the start of its progress (from
   * ``progress``, unless the stream left it out for its size), not the data itself. */
  function cardData(task, progress, elided) {
    if (elided.includes("progress")) task.progress_text = "(progress too large to show here)";
    else if (progress !== undefined) task.progress_text = progressText(progress);
    for (const name of ["payload", "description", "result", "progress"]) delete task[name];
  }

  function boardPage() {
    const columns = {};
    for (const section of document.querySelectorAll("[data-column]")) {
      columns[section.dataset.column] = section;
    }
    const tasks = new Map(); // id -> task, for the cards on the page
    const statusOf = new Map(); // id -> status, for every task of this filter seen
    const foreign = new Set(); // tasks of other queues, when the board is filtered
    const seen = eventIds(STATE.skip);
    const counts = { ...STATE.counts };
    // dependency id -> the ids of the drawn tasks that depend on it, to redraw their
    // "Waiting for" when it changes, and to read them again when it is requeued.
    const dependents = new Map();
    const glanceSoon = glancePanels((fresh) => {
      // The server's counters are the truth; events move the counts in between.
      for (const status of Object.keys(counts)) counts[status] = fresh[status] ?? 0;
      refreshCounts();
    });

    function index(task) {
      for (const dep of task.depends_on ?? []) {
        if (!dependents.has(dep)) dependents.set(dep, new Set());
        dependents.get(dep).add(task.id);
      }
    }

    function cardOf(id) {
      return document.querySelector(`.columns .card[data-task-id="${id}"]`);
    }

    function place(task, { flash = false } = {}) {
      cardOf(task.id)?.remove();
      const key = COLUMN_OF[task.status];
      const list = columns[key].querySelector("[data-cards]");
      const card = renderCard(task);
      if (flash) card.classList.add("flash");
      let before = null;
      for (const other of list.children) {
        const shown = tasks.get(Number(other.dataset.taskId));
        if (shown && ORDER[key](task, shown) < 0) {
          before = other;
          break;
        }
      }
      list.insertBefore(card, before);
      if (key === "finished") {
        while (list.children.length > STATE.finished_limit) {
          tasks.delete(Number(list.lastElementChild.dataset.taskId));
          list.lastElementChild.remove();
        }
      }
    }

    function refreshCounts() {
      for (const node of document.querySelectorAll("[data-count]")) {
        node.textContent = counts[node.dataset.count] ?? 0;
      }
      const total = {
        pending: counts.pending, in_progress: counts.in_progress, escalated: counts.escalated,
        finished: counts.done + counts.cancelled,
      };
      for (const [key, section] of Object.entries(columns)) {
        const shown = section.querySelector("[data-cards]").children.length;
        section.querySelector("[data-column-count]").textContent = total[key];
        section.querySelector(".column-empty").hidden = shown > 0;
        const more = section.querySelector("[data-more]");
        const hidden = total[key] - shown;
        more.hidden = key === "finished" || hidden <= 0;
        more.textContent = `${hidden} more not shown`;
      }
    }

    function addQueueOption(queue) {
      const select = document.getElementById("queue-select");
      if (!select || [...select.options].some((option) => option.value === queue)) return;
      // As the server draws it, the filter offers no more queues than the panel shows.
      if (select.options.length > (STATE.queues_limit ?? 50)) return;
      const options = [...select.options].slice(1);
      const next = options.find((option) => option.value > queue) ?? null;
      select.insertBefore(h("option", { value: queue }, queue), next);
    }

    async function apply(event) {
      if (seen.has(event.id)) return;
      seen.add(event.id);
      glanceSoon();
      const id = event.task_id;
      // Known (dependencies of drawn cards) follows every task, also of other queues.
      Known.follow(event);
      await redrawDependents(id, event);
      if (foreign.has(id)) return;
      if (event.type === "created") addQueueOption(event.payload?.queue ?? "default");
      let task = tasks.get(id);
      if (!task) {
        // A task the page has not drawn: new, or beyond what the columns show.
        const sent = sentTask(event);
        task = sent && !sent.elided.includes("last_error") ? sent.task : await fetchTask(id);
        if (!task) return;
        if (STATE.queue && task.queue !== STATE.queue) {
          foreign.add(id);
          return;
        }
        // A new task has no comments; of another, the page does not know how many.
        if (event.type === "created") task.comments = 0;
        cardData(task, task.progress, task === sent?.task ? sent.elided : []);
      }
      // Where the page does not know the status before (a task beyond the columns), the
      // counts wait for the queues panel's next reading, which replaces them.
      const before = statusOf.has(id) ? statusOf.get(id) : event.type === "created" ? null : undefined;
      const elided = applyToTask(task, event);
      if (event.task) cardData(task, event.task.progress, elided);
      if (event.type === "commented" && typeof task.comments === "number") task.comments += 1;
      if (elided.includes("last_error")) {
        // A card shows the start of the error: read the task for it.
        reread(id, (fresh) => {
          const drawn = tasks.get(id);
          if (!drawn) return;
          drawn.last_error = fresh.last_error;
          place(drawn);
        });
      }
      Known.set({ id, title: task.title, status: task.status, blocked: task.blocked });
      if (task.blocked) await Known.learn(task.depends_on ?? []);
      index(task);
      if (before !== undefined && before !== task.status) {
        if (before) counts[before] -= 1;
        counts[task.status] += 1;
      }
      statusOf.set(id, task.status);
      tasks.set(id, task);
      if (task.status !== "in_progress") Leases.settling.delete(id);
      place(task, { flash: event.type !== "heartbeat" });
      refreshCounts();
      Leases.check(task, event);
    }

    /** Redraw the cards waiting for task ``id`` after ``event`` on it; after a requeue of
     * a done task, read them again: each waits for it once more. */
    async function redrawDependents(id, event) {
      const waiting = [...(dependents.get(id) ?? [])].filter((other) => tasks.has(other));
      if (!waiting.length) return;
      const reopened = event.type === "requeued" && event.payload?.previous_status === "done";
      for (const other of waiting) {
        if (reopened) {
          const fresh = await fetchTask(other);
          if (fresh) Object.assign(tasks.get(other), fresh);
        }
        place(tasks.get(other));
      }
    }

    Leases.onChange = (id) => {
      const task = tasks.get(id);
      if (task) place(task);
    };

    // Draw every card with the same code that draws the live changes.
    for (const info of Object.values(STATE.dependencies ?? {})) Known.set(info);
    for (const task of STATE.tasks) {
      tasks.set(task.id, task);
      statusOf.set(task.id, task.status);
      Known.set({ id: task.id, title: task.title, status: task.status, blocked: task.blocked });
      index(task);
    }
    for (const task of STATE.tasks) place(task);
    refreshCounts();

    document.getElementById("queue-select")?.addEventListener("change", (change) => {
      change.target.form.submit();
    });

    const claimButton = document.getElementById("claim-next");
    claimButton?.addEventListener("click", async () => {
      claimButton.disabled = true;
      const body = { lease_seconds: STATE.lease_seconds };
      if (STATE.queue) body.queues = [STATE.queue];
      const result = await api("POST", "tasks/claim/", body);
      claimButton.disabled = false;
      if (!result.ok) {
        notify(errorText(result, "The claim failed."), { kind: "error" });
      } else if (result.data.tasks.length === 0) {
        notify(STATE.queue ? `Nothing to claim in ${STATE.queue}.` : "Nothing to claim.");
      } else {
        const claimed = result.data.tasks[0];
        Leases.hold(claimed.id, claimed.lease_token, STATE.lease_seconds);
        notify(`You hold #${claimed.id} ${claimed.title}. This page keeps the lease alive.`);
      }
    });

    const form = document.getElementById("new-task-form");
    const formSection = document.getElementById("new-task");
    const toggle = document.getElementById("new-task-toggle");
    function showForm(open) {
      formSection.hidden = !open;
      toggle.setAttribute("aria-expanded", String(open));
      if (open) form.elements.title.focus();
    }
    toggle?.addEventListener("click", () => showForm(formSection.hidden));
    form?.querySelector("[data-close]")?.addEventListener("click", () => showForm(false));
    form?.addEventListener("submit", async (submit) => {
      submit.preventDefault();
      const problem = form.querySelector("[data-form-error]");
      const fail = (text) => {
        problem.textContent = text;
        problem.hidden = false;
      };
      problem.hidden = true;
      const data = new FormData(form);
      let payload;
      try {
        payload = JSON.parse(String(data.get("payload") || "").trim() || "{}");
      } catch {
        return fail("Payload: this is not valid JSON.");
      }
      if (payload === null || typeof payload !== "object" || Array.isArray(payload)) {
        return fail('Payload: must be a JSON object, such as {"key": "value"}.');
      }
      const priorityText = String(data.get("priority") || "0").trim();
      const priority = Number(priorityText);
      if (!/^-?\d+$/.test(priorityText)) return fail("Priority: a whole number, -1000 to 1000.");
      const body = {
        title: String(data.get("title") || "").trim(),
        description: String(data.get("description") || ""),
        queue: String(data.get("queue") || "").trim() || "default",
        priority,
        payload,
      };
      const button = form.querySelector('button[type="submit"]');
      button.disabled = true;
      const result = await api("POST", "tasks/", body);
      button.disabled = false;
      if (!result.ok) return fail(errorText(result, "The task could not be created."));
      form.reset();
      form.elements.queue.value = STATE.queue || "default";
      form.elements.payload.value = "{}";
      showForm(false);
      const elsewhere = STATE.queue && result.data.queue !== STATE.queue;
      notify(`Created #${result.data.id}${elsewhere ? ` in ${result.data.queue} (another queue)` : ""}.`);
    });

    connect(serially(apply));
  }

  // -- A task's page ---------------------------------------------------------------------

  // A timeline shows this much of an event's text, and links the event's page for the rest
  // (board_extras.clip).
  const TEXT_LIMIT = STATE.event_text_limit ?? 1000;
  const clip = (text) => truncate(text, TEXT_LIMIT);

  // What the timeline shows for a value the stream left out for its size: the task's
  // events (the API, or the page drawn again) have it.
  const TOO_LARGE = "(too large to show live: reload the page to see it)";

  /** An event's payload as key: value lines (strings as they are, the rest as JSON), long
   * texts cut short; a value the stream left out for its size (``elided``) says so. */
  function eventData(payload, elided = []) {
    const keys = [...new Set([...Object.keys(payload), ...elided])].sort();
    if (!keys.length) return null;
    return h("dl", { class: "event-data" }, keys.map((key) => {
      const value = payload[key];
      if (elided.includes(key)) {
        return [h("dt", {}, key), h("dd", { class: "muted" }, TOO_LARGE)];
      }
      if (typeof value === "string" && TIMESTAMP.test(value)) {
        return [h("dt", {}, key), h("dd", {}, h("time", { datetime: value }, absolute(value)))];
      }
      return [
        h("dt", {}, key),
        h("dd", { class: typeof value === "string" ? null : "mono" },
          clip(typeof value === "string" ? value : JSON.stringify(sortedKeys(value)))),
      ];
    }));
  }

  /** Whether the timeline cuts some of ``event`` short, or the stream left some out. */
  function clipped(event) {
    if ((event.elided ?? []).length) return true;
    return Object.values(event.payload || {}).some((value) =>
      (typeof value === "string" ? value : JSON.stringify(value)).length > TEXT_LIMIT);
  }

  /** A timeline entry: ``event``, or with ``run`` ({ids, firstAt}) the last heartbeat of a
   * run shown as one ("12 heartbeats, 10:02–10:06"), as board/pages/timeline.py draws it. */
  function renderEvent(event, run = null) {
    const payload = event.payload || {};
    const dataset = { eventId: event.id, actor: event.actor };
    if (run) Object.assign(dataset, { eventIds: run.ids.join(" "), firstAt: run.firstAt });
    const when = run
      ? h("span", {
        class: "event-span",
        // A run within one minute shows seconds, where "10:02–10:02" would say nothing.
        "data-seconds": Math.floor(Date.parse(run.firstAt) / 60000)
          === Math.floor(Date.parse(event.created_at) / 60000) ? "" : null,
      },
        h("time", { datetime: run.firstAt, "data-clock": "" }), "–",
        h("time", { datetime: event.created_at, "data-clock": "" }))
      : timeElement(event.created_at);
    const item = h("li", {
      class: `event event-${event.type}${run ? " event-run" : ""} new`, id: `event-${event.id}`, dataset,
    },
      h("div", { class: "event-head" },
        h("span", { class: "event-type" }, run ? `${run.ids.length} heartbeats` : event.type),
        h("span", { class: "event-actor" }, "by ", h("b", {}, event.actor)),
        h("span", { class: `badge badge-${event.status}` }, label(event.status)),
        when),
      event.type === "commented"
        ? h("p", { class: event.elided?.includes("body") ? "comment-body muted" : "comment-body" },
          event.elided?.includes("body") ? TOO_LARGE : clip(String(payload.body ?? "")))
        : eventData(payload, event.elided ?? []),
      clipped(event)
        ? h("p", { class: "event-more" },
          h("a", { href: `/tasks/${event.task_id}/events/${event.id}/` }, "Show all of this event"))
        : null);
    if (run) refreshTimes(item);
    return item;
  }

  /** The ids of the events a timeline entry stands for (a run of heartbeats: all of them). */
  const entryIds = (item) => (item.dataset.eventIds ?? item.dataset.eventId).split(" ").map(Number);

  /** Add ``event`` to a task's timeline; a heartbeat that follows one of the same holder
   * joins it (or its run), as the server draws the page. The API keeps every event. */
  function addToTimeline(timeline, event) {
    const last = timeline.lastElementChild;
    if (event.type === "heartbeat" && last?.classList.contains("event-heartbeat")
        && last.dataset.actor === event.actor) {
      const firstAt = last.dataset.firstAt ?? last.querySelector("time")?.getAttribute("datetime");
      last.replaceWith(renderEvent(event, { ids: [...entryIds(last), event.id], firstAt }));
      return;
    }
    timeline.append(renderEvent(event));
  }

  /** A related task on a task's page: link, status, blocked, and a child's progress. */
  function relatedItem(item, { progress = false } = {}) {
    if (item.hidden) {
      return h("span", { class: "related", dataset: { relatedId: item.id } },
        `#${item.id} `, h("span", { class: "muted" }, "(a queue you cannot see)"));
    }
    const shown = progress && item.progress !== null && item.progress !== undefined
      ? truncate(JSON.stringify(sortedKeys(item.progress)), 120)
      : null;
    return h("span", { class: "related", dataset: { relatedId: item.id } },
      h("a", { href: `/tasks/${item.id}/` }, `#${item.id} ${item.title ?? ""}`), " ",
      h("span", { class: `badge badge-${item.status}` }, label(item.status)),
      item.blocked ? [" ", h("span", { class: "badge badge-blocked" }, "blocked")] : null,
      shown ? [" ", h("code", { class: "related-progress", title: "Latest progress" }, shown)] : null);
  }

  function taskPage() {
    const task = STATE.task;
    const seen = eventIds(STATE.skip);
    const timeline = document.querySelector("[data-timeline]");
    const field = (name) => document.querySelector(`[data-field="${name}"]`);
    for (const item of timeline.children) for (const id of entryIds(item)) seen.add(id);
    let eventCount = STATE.event_count;

    const relations = STATE.relations ?? { parent: null, children: [], dependencies: [], dependents: [] };
    // Every related task by id (one task may be in two lists), kept current by events.
    const related = new Map();
    const remember = (item) => {
      const known = related.get(item.id);
      if (known) return Object.assign(known, item);
      related.set(item.id, item);
      return item;
    };
    if (relations.parent) relations.parent = remember(relations.parent);
    for (const key of ["children", "dependencies", "dependents"]) {
      relations[key] = relations[key].map(remember);
    }

    function fillRelations() {
      const parent = document.querySelector('[data-relation="parent"]');
      parent?.replaceChildren(relations.parent ? relatedItem(relations.parent) : h("span", { class: "muted" }, "none"));
      const empty = { children: "none", dependencies: "nothing", dependents: "none" };
      for (const key of Object.keys(empty)) {
        const list = document.querySelector(`[data-relation="${key}"]`);
        if (!list) continue;
        const items = relations[key].map((item) => h("li", {}, relatedItem(item, { progress: key === "children" })));
        list.replaceChildren(...(items.length ? items : [h("li", { class: "muted" }, empty[key])]));
      }
    }

    /** Follow an event on another task: a related one's status, a new child or dependent. */
    async function applyToRelated(event) {
      const payload = event.payload || {};
      const fresh = event.task;
      if (event.type === "created" && !related.has(event.task_id)) {
        const created = fresh ?? { ...payload, status: event.status, blocked: payload.blocked ?? false };
        const item = {
          id: event.task_id, title: created.title, status: created.status,
          blocked: created.blocked, progress: null,
        };
        if (created.parent_id === task.id) relations.children.push(remember(item));
        if ((created.depends_on ?? []).includes(task.id)) relations.dependents.push(remember(item));
        fillRelations();
        return;
      }
      const item = related.get(event.task_id);
      if (!item || item.hidden || !fresh) return;
      Object.assign(item, { status: fresh.status, blocked: fresh.blocked });
      if (fresh.elided?.includes("progress")) {
        reread(item.id, (read) => {
          item.progress = read.progress;
          fillRelations();
        });
      } else {
        item.progress = fresh.progress;
      }
      fillRelations();
    }

    function fill() {
      const status = field("status");
      status.className = `badge badge-${task.status}`;
      status.textContent = label(task.status);
      const panel = field("lease-panel");
      panel.hidden = task.status !== "in_progress";
      panel.classList.remove("stalled");
      field("holder").textContent = task.leased_by ?? "";
      const lease = field("lease");
      if (task.leased_until) lease.dataset.until = task.leased_until;
      else delete lease.dataset.until;
      lease.textContent = "";
      field("stalled").hidden = true;
      field("blocked").hidden = !task.blocked;
      // Shown only to those who may triage (the server draws it for them alone).
      const triage = field("triage-panel");
      if (triage) triage.hidden = task.status !== "escalated";
      const deadline = deadlineOf(task);
      const deadlineNode = field("deadline");
      deadlineNode.hidden = !deadline;
      if (deadline) deadlineNode.dataset.deadline = deadline;
      else delete deadlineNode.dataset.deadline;
      deadlineNode.textContent = "";
      const hasProgress = task.progress !== null && task.progress !== undefined;
      field("progress").hidden = !hasProgress;
      field("progress").textContent = hasProgress ? prettyJSON(task.progress) : "";
      field("no-progress").hidden = hasProgress;
      const actions = panel.querySelector("[data-actions]");
      actions.replaceChildren(...[holdingOf(task, { withResult: true })].filter(Boolean));
      field("strikes").textContent = `${task.failure_count} of ${task.max_failures}`;
      field("run_after").replaceChildren(task.run_after ? timeElement(task.run_after) : "—");
      field("updated").replaceChildren(timeElement(task.updated_at));
      field("error-panel").hidden = !task.last_error;
      field("last_error").textContent = task.last_error ?? "";
      const hasResult = task.result !== null && task.result !== undefined;
      field("result").hidden = !hasResult;
      field("result").textContent = hasResult ? prettyJSON(task.result) : "";
      field("no-result").hidden = hasResult;
      field("event-count").textContent = eventCount;
      refreshLeases();
      refreshTimes();
    }

    // The values of the task that this page shows as they change (its description and
    // payload are drawn by the server).
    const SHOWN = ["progress", "result", "last_error"];

    async function apply(event) {
      if (event.task_id !== task.id) {
        await applyToRelated(event);
        return;
      }
      if (seen.has(event.id)) return;
      seen.add(event.id);
      eventCount += 1;
      // An older page of the timeline stays as it is: its "Newer events" lead on.
      if (STATE.timeline_live) addToTimeline(timeline, event);
      const elided = applyToTask(task, event).filter((name) => SHOWN.includes(name));
      if (elided.length) {
        // The page shows these as they change: read what the stream left out.
        reread(task.id, (fresh) => {
          for (const name of SHOWN) task[name] = fresh[name];
          fill();
        });
      }
      if (task.status !== "in_progress") Leases.settling.delete(task.id);
      fill();
      Leases.check(task, event);
    }

    Leases.onChange = (id) => {
      if (id === task.id) fill();
    };
    fillRelations();
    fill();
    connect(serially(apply));
  }

  // -- Start -----------------------------------------------------------------------------

  for (const id of Leases.ids()) Leases.keepAlive(id, true);
  if (STATE.page === "board") boardPage();
  else if (STATE.page === "task") taskPage();
  refreshTimes();
  refreshLeases();
  let ticks = 0;
  setInterval(() => {
    refreshLeases();
    ticks += 1;
    if (ticks % 10 === 0) refreshTimes();
  }, 1000);
})();
