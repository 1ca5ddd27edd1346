// Regatta's dashboard: one page, no framework, no other origin. Every value from the
// cluster reaches the page as text (textContent), never as markup.
'use strict';

const REFRESH_MS = 1500;
const PAGE = 100;

const ui = { route: null, timer: null, busy: false, job: null };

// ---- DOM helpers ---------------------------------------------------------------------

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === 'class') node.className = value;
    else if (key.startsWith('on')) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? '' : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function svg(tag, attrs) {
  const node = document.createElementNS('http://www.w3.org/2000/svg', tag);
  for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
  return node;
}

const $ = (selector) => document.querySelector(selector);

function replace(target, ...children) {
  target.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined));
}

function fmtBytes(bytes) {
  if (!bytes) return '0 B';
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return `${value.toFixed(unit ? 1 : 0)} ${units[unit]}`;
}

function fmtSeconds(seconds) {
  if (seconds === null || seconds === undefined) return '';
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.floor(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.floor((seconds % 3600) / 60)} min`;
}

function fmtNumber(value) {
  if (value === null || value === undefined) return '';
  if (Math.abs(value) >= 1000) return Math.round(value).toLocaleString('en');
  return Number(value.toPrecision(4)).toString();
}

function fmtResources(resources) {
  return Object.entries(resources || {})
    .map(([name, amount]) => (name === 'memory' ? `memory ${fmtBytes(amount)}` : `${name}=${fmtNumber(amount)}`))
    .join(', ');
}

function fmtUse(total, used) {
  return Object.entries(total || {})
    .map(([name, amount]) => {
      const inUse = (used || {})[name] || 0;
      return name === 'memory' ? `memory ${fmtBytes(inUse)}/${fmtBytes(amount)}` : `${name} ${fmtNumber(inUse)}/${fmtNumber(amount)}`;
    })
    .join(', ');
}

function stateCell(state) {
  return el('td', { class: `state-${state}` }, state);
}

function table(id, headings, rows) {
  return el('table', { id },
    el('thead', {}, el('tr', {}, headings.map((h) => el('th', {}, h)))),
    el('tbody', {}, rows));
}

function facts(pairs) {
  return el('dl', { class: 'facts' }, pairs.flatMap(([name, value]) => [el('dt', {}, name), el('dd', {}, value)]));
}

function card(label, value, detail) {
  return el('div', { class: 'card' }, el('div', { class: 'label' }, label), el('div', { class: 'value' }, value),
    detail ? el('div', { class: 'detail' }, detail) : null);
}

// ---- the API -------------------------------------------------------------------------

class SignedOut extends Error {}

// The session lives in an HttpOnly cookie the head set at sign-in: this script never
// holds a credential, and the browser sends the cookie to this origin only.
async function api(path, options = {}) {
  const response = await fetch(path, { ...options, cache: 'no-store', credentials: 'same-origin' });
  const body = await response.json().catch(() => ({}));
  if (response.status === 401) {
    signOut(ui.signedIn ? `Signed out: ${body.error || response.statusText}` : '');
    throw new SignedOut();
  }
  if (!response.ok) throw new Error(body.error || `${response.status} ${response.statusText}`);
  return body;
}

function query(params) {
  const search = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) if (value !== '' && value !== undefined && value !== null) search.set(key, value);
  const text = search.toString();
  return text ? `?${text}` : '';
}

// ---- sign in and out -----------------------------------------------------------------

function signOut(message) {
  ui.signedIn = false;
  clearInterval(ui.timer);
  ui.timer = null;
  $('#nav').hidden = true;
  $('#logout').hidden = true;
  replace($('#view'));
  $('#login').hidden = false;
  $('#login-error').textContent = message || '';
  $('#login-token').value = '';
  $('#login-token').focus();
}

async function signIn(event) {
  event.preventDefault();
  const token = $('#login-token').value.trim();
  if (!token) return;
  $('#login-token').value = '';
  let response;
  try {
    response = await fetch('/api/login', {
      method: 'POST', cache: 'no-store', credentials: 'same-origin',
      headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ token }),
    });
  } catch (error) {
    $('#login-error').textContent = `Cannot reach the head: ${error.message}`;
    return;
  }
  if (!response.ok) {
    const body = await response.json().catch(() => ({}));
    $('#login-error').textContent = `The head refused the sign-in: ${body.error || response.statusText}`;
    return;
  }
  start();
}

async function logOut() {
  await fetch('/api/logout', { method: 'POST', cache: 'no-store', credentials: 'same-origin' }).catch(() => {});
  signOut('');
}

function start() {
  ui.signedIn = true;
  $('#login').hidden = true;
  $('#nav').hidden = false;
  $('#logout').hidden = false;
  if (!location.hash) location.hash = '#/overview';
  route();
  clearInterval(ui.timer);
  ui.timer = setInterval(refresh, REFRESH_MS);
}

// ---- routing ---------------------------------------------------------------------------

const pages = {
  overview: { mount: () => [el('h1', {}, 'Cluster'), el('div', { id: 'overview' })], update: updateOverview },
  nodes: { mount: mountNodes, update: updateNodes },
  actors: { mount: mountActors, update: updateActors },
  actor: {
    mount: (id) => [el('h1', {}, `Actor ${id}`), el('div', { id: 'actor' }), el('h2', {}, 'Recent log lines'),
      el('pre', { class: 'log', id: 'actor-log' })],
    update: updateActor,
  },
  jobs: { mount: () => [el('h1', {}, 'Jobs'), el('div', { id: 'jobs' })], update: updateJobs },
  job: { mount: mountJob, update: updateJob },
  runs: { mount: () => [el('h1', {}, 'Training and scoring runs'), el('div', { id: 'runs' })], update: updateRuns },
  run: { mount: (name) => [el('h1', {}, `Run ${name}`), el('div', { id: 'run' })], update: updateRun },
};

function parseHash() {
  const [path, search] = location.hash.replace(/^#\/?/, '').split('?');
  const [page, ...rest] = path.split('/');
  return { page: pages[page] ? page : 'overview', arg: decodeURIComponent(rest.join('/')), params: new URLSearchParams(search || '') };
}

function route() {
  if (!ui.signedIn) return;
  ui.route = parseHash();
  ui.job = null;
  for (const link of document.querySelectorAll('#nav a')) {
    const current = link.dataset.page === ui.route.page || `${link.dataset.page}` === `${ui.route.page}s`;
    link.classList.toggle('active', current);
  }
  replace($('#view'), pages[ui.route.page].mount(ui.route.arg, ui.route.params));
  refresh();
}

async function refresh() {
  if (ui.busy || !ui.route) return;
  ui.busy = true;
  const shown = ui.route;
  try {
    await pages[shown.page].update(shown.arg, shown.params);
    if (shown === ui.route) $('#live').textContent = `updated ${new Date().toLocaleTimeString()}`;
  } catch (error) {
    if (!(error instanceof SignedOut)) $('#live').textContent = `update failed: ${error.message}`;
  } finally {
    ui.busy = false;
  }
}

// ---- pages -----------------------------------------------------------------------------

async function updateOverview() {
  const o = await api('/api/cluster');
  const actors = o.actors || {};
  const groups = o.groups || {};
  const jobs = o.jobs || {};
  replace($('#overview'),
    el('div', { class: 'cards' },
      card('Nodes', `${o.nodes_alive} alive`, `${o.nodes_dead} dead`),
      card('Actors', `${actors.alive || 0} alive`,
        `${actors.pending || 0} pending, ${actors.starting || 0} starting, ${actors.restarting || 0} restarting, ${actors.dead || 0} dead`),
      card('Placement groups', `${groups.created || 0} created`, `${groups.pending || 0} pending, ${groups.rescheduling || 0} rescheduling`),
      card('Waiting requests', `${o.waiting}`, 'actors and groups waiting for resources'),
      card('Object store', fmtBytes(o.objects.bytes), `${o.objects.objects} objects, ${fmtBytes(o.objects.spilled_bytes)} spilled, ${o.objects.lost} lost`),
      card('Jobs', `${jobs.RUNNING || 0} running`, Object.entries(jobs).map(([s, n]) => `${n} ${s.toLowerCase()}`).join(', ') || 'none'),
      card('Runs', `${o.runs}`, 'training and scoring runs kept')),
    el('h2', {}, 'Resources on alive nodes'),
    table('resources-table', ['Resource', 'In use', 'Total'], o.resources.map((r) => el('tr', {},
      el('td', {}, r.name),
      el('td', { class: 'num' }, r.name === 'memory' ? fmtBytes(r.used) : fmtNumber(r.used)),
      el('td', { class: 'num' }, r.name === 'memory' ? fmtBytes(r.total) : fmtNumber(r.total))))));
}

function pager(page, onMove) {
  const last = Math.min(page.offset + page.items.length, page.total);
  return el('div', { class: 'pager' },
    el('button', { type: 'button', disabled: page.offset === 0, onclick: () => onMove(Math.max(0, page.offset - page.limit)) }, '‹ Previous'),
    el('span', {}, page.total ? `${page.offset + 1}–${last} of ${page.total}` : 'none'),
    el('button', { type: 'button', disabled: last >= page.total, onclick: () => onMove(page.offset + page.limit) }, 'Next ›'));
}

function mountNodes() {
  return [el('h1', {}, 'Nodes'), el('div', { id: 'nodes' })];
}

async function updateNodes(_, params) {
  const offset = Number(params.get('offset') || 0);
  const page = await api(`/api/nodes${query({ offset, limit: PAGE })}`);
  replace($('#nodes'),
    pager(page, (o) => { location.hash = `#/nodes?offset=${o}`; }),
    table('nodes-table', ['Node', 'State', 'For', 'Heartbeat', 'Address', 'Actors', 'Objects', 'Resources (used/total)', 'Kinds', 'Cause'],
      page.items.map((n) => el('tr', { 'data-node': n.name },
        el('td', {}, el('a', { href: `#/actors?node=${encodeURIComponent(n.name)}` }, n.name)),
        stateCell(n.state),
        el('td', {}, fmtSeconds(n.since_s)),
        el('td', {}, n.heartbeat_age_s === null ? '' : `${n.heartbeat_age_s.toFixed(1)} s ago`),
        el('td', {}, n.address),
        el('td', { class: 'num' }, n.actors),
        el('td', { class: 'num' }, fmtBytes(n.object_bytes)),
        el('td', {}, fmtUse(n.total, n.used)),
        el('td', {}, n.kinds.join(', ')),
        el('td', { class: 'error' }, n.cause || '')))));
}

const FILTERS = ['kind', 'state', 'node', 'job', 'name'];

function mountActors(_, params) {
  const input = (name) => (name === 'state'
    ? el('select', { name, id: 'filter-state' }, ['', 'pending', 'starting', 'alive', 'restarting', 'dead'].map((s) =>
      el('option', { value: s, selected: params.get('state') === s && s !== '' }, s || 'any state')))
    : el('input', { name, id: `filter-${name}`, placeholder: name, value: params.get(name) || '' }));
  const form = el('form', { class: 'filters', id: 'actor-filters' },
    FILTERS.map(input),
    el('button', { type: 'submit', class: 'primary' }, 'Filter'));
  form.addEventListener('submit', (event) => {
    event.preventDefault();
    const values = Object.fromEntries(FILTERS.map((f) => [f, form.elements[f].value.trim()]));
    location.hash = `#/actors${query(values)}`;
  });
  return [el('h1', {}, 'Actors'), form, el('div', { id: 'actors' })];
}

async function updateActors(_, params) {
  const filters = Object.fromEntries(FILTERS.map((f) => [f, params.get(f) || '']));
  const offset = Number(params.get('offset') || 0);
  const page = await api(`/api/actors${query({ ...filters, offset, limit: PAGE })}`);
  replace($('#actors'),
    pager(page, (o) => { location.hash = `#/actors${query({ ...filters, offset: o })}`; }),
    table('actors-table', ['Id', 'Name', 'Kind', 'State', 'Node', 'Restarts', 'Job', 'Resources', 'GPUs'],
      page.items.map((a) => el('tr', { 'data-actor': a.id },
        el('td', {}, el('a', { href: `#/actor/${a.id}` }, a.id)),
        el('td', {}, a.name || ''),
        el('td', {}, a.kind),
        stateCell(a.state),
        el('td', {}, a.node || ''),
        el('td', { class: 'num' }, `${a.restarts}/${a.max_restarts === 4294967295 ? '∞' : a.max_restarts}`),
        el('td', {}, a.job ? el('a', { href: `#/job/${encodeURIComponent(a.job)}` }, a.job) : ''),
        el('td', {}, fmtResources(a.resources)),
        el('td', {}, a.gpu_ids.join(', '))))));
}

async function updateActor(id) {
  const a = await api(`/api/actors/${encodeURIComponent(id)}`);
  replace($('#actor'), facts([
    ['Kind', a.kind],
    ['Name', a.name || '—'],
    ['State', el('span', { class: `state-${a.state}`, id: 'actor-state' }, a.state)],
    ['Death cause', a.cause || '—'],
    ['Node', a.node || '—'],
    ['Resources', fmtResources(a.resources) || 'none'],
    ['GPU indices', a.gpu_ids.length ? a.gpu_ids.join(', ') : '—'],
    ['Restarts', `${a.restarts} of ${a.max_restarts === 4294967295 ? 'unlimited' : a.max_restarts}`],
    ['Placement group', a.group ? `${a.group[0]}${a.group[1] === null ? '' : ` bundle ${a.group[1]}`}` : '—'],
    ['Job', a.job ? el('a', { href: `#/job/${encodeURIComponent(a.job)}` }, a.job) : '—'],
    ['Waiting', a.waiting_s === null ? '—' : fmtSeconds(a.waiting_s)],
  ]));
  let text;
  try {
    const logs = await api(`/api/actors/${encodeURIComponent(id)}/logs`);
    text = logs.lines.length
      ? logs.lines.map((l) => `${new Date(l.at_ms).toISOString()}  ${l.text}`).join('\n')
      : 'no lines (an actor that never ran, or its node forgot it)';
  } catch (error) {
    if (error instanceof SignedOut) throw error;
    text = `log lines unavailable: ${error.message}`;
  }
  const log = $('#actor-log');
  if (log.textContent !== text) log.textContent = text;
}

// The driver's reservation, as `CPU=1, GPU=1, memory=...` (Ray's fields).
function resourcesText(job) {
  const parts = [];
  if (job.entrypoint_num_cpus) parts.push(`CPU=${job.entrypoint_num_cpus}`);
  if (job.entrypoint_num_gpus) parts.push(`GPU=${job.entrypoint_num_gpus}`);
  if (job.entrypoint_memory) parts.push(`memory=${job.entrypoint_memory}`);
  for (const [name, amount] of Object.entries(job.entrypoint_resources || {})) parts.push(`${name}=${amount}`);
  return parts.length ? parts.join(', ') : '—';
}

function duration(job) {
  if (!job.start_time) return '';
  const end = job.end_time || Date.now();
  return fmtSeconds((end - job.start_time) / 1000);
}

async function updateJobs() {
  const jobs = await api('/api/jobs');
  jobs.sort((a, b) => b.submitted_at - a.submitted_at);
  replace($('#jobs'), table('jobs-table', ['Job', 'State', 'Entrypoint', 'Submitted', 'Duration', 'Message'],
    jobs.map((j) => el('tr', { 'data-job': j.job_id },
      el('td', {}, el('a', { href: `#/job/${encodeURIComponent(j.job_id)}` }, j.job_id)),
      stateCell(j.status),
      el('td', {}, el('code', {}, j.entrypoint)),
      el('td', {}, new Date(j.submitted_at).toLocaleString()),
      el('td', {}, duration(j)),
      el('td', {}, j.message)))));
}

function mountJob(id) {
  const follow = el('input', { type: 'checkbox', id: 'job-follow', checked: true });
  return [
    el('h1', {}, `Job ${id}`),
    el('div', { id: 'job' }),
    el('p', {}, el('button', { type: 'button', class: 'danger', id: 'job-stop', hidden: true, onclick: () => stopJob(id) }, 'Stop job')),
    el('h2', {}, 'Log ', el('label', { class: 'muted' }, follow, ' follow')),
    el('pre', { class: 'log', id: 'job-log' }),
  ];
}

async function stopJob(id) {
  if (!window.confirm(`Stop job ${id}? Its driver and its actors are stopped.`)) return;
  $('#job-stop').disabled = true;
  try {
    await api(`/api/jobs/${encodeURIComponent(id)}/stop`, { method: 'POST' });
  } catch (error) {
    if (!(error instanceof SignedOut)) $('#live').textContent = `stop failed: ${error.message}`;
  }
  refresh();
}

async function updateJob(id) {
  if (!ui.job || ui.job.id !== id) ui.job = { id, offset: 0 };
  const job = await api(`/api/jobs/${encodeURIComponent(id)}`);
  const terminal = ['SUCCEEDED', 'FAILED', 'STOPPED'].includes(job.status);
  replace($('#job'), facts([
    ['State', el('span', { class: `state-${job.status}`, id: 'job-status' }, job.status)],
    ['Entrypoint', el('code', {}, job.entrypoint)],
    ['Message', job.message || '—'],
    ['Submitted', new Date(job.submitted_at).toLocaleString()],
    ['Duration', duration(job)],
    ['Exit code', job.driver_exit_code === null ? '—' : job.driver_exit_code],
    ['Resources', resourcesText(job)],
  ]));
  const stop = $('#job-stop');
  stop.hidden = terminal;
  // Everything written since the last read; the head caps one answer, so read until caught up.
  const log = $('#job-log');
  for (let reads = 0; reads < 8; reads += 1) {
    const chunk = await api(`/api/jobs/${encodeURIComponent(id)}/logs?offset=${ui.job.offset}`);
    if (ui.job.id !== id) return;
    if (chunk.offset < ui.job.offset) log.textContent = '';
    if (chunk.logs) log.append(document.createTextNode(chunk.logs));
    const moved = chunk.offset !== ui.job.offset;
    ui.job.offset = chunk.offset;
    if (!moved) break;
  }
  if ($('#job-follow').checked) log.scrollTop = log.scrollHeight;
}

async function updateRuns() {
  const { runs } = await api('/api/runs');
  replace($('#runs'), runs.length === 0
    ? el('p', { class: 'muted' }, 'No runs yet: training and scoring drivers report here as they go.')
    : table('runs-table', ['Run', 'Kind', 'Job', 'Step', 'Latest', 'Duration', 'State'],
      runs.map((r) => el('tr', { 'data-run': r.name },
        el('td', {}, el('a', { href: `#/run/${encodeURIComponent(r.name)}` }, r.name)),
        el('td', {}, r.kind),
        el('td', {}, r.job ? el('a', { href: `#/job/${encodeURIComponent(r.job)}` }, r.job) : ''),
        el('td', { class: 'num' }, r.step),
        el('td', {}, Object.entries(r.last).map(([k, v]) => `${k} ${fmtNumber(v)}`).join(', ')),
        el('td', {}, fmtSeconds(r.duration_s)),
        el('td', {}, r.finished ? 'finished' : `${r.idle_s < 60 ? 'running' : 'idle'}`)))));
}

// Chart order: the figures people look at first.
const SERIES_ORDER = ['loss', 'eval_loss', 'eval_perplexity', 'lr', 'grad_norm', 'tokens_per_sec', 'step_secs', 'collective_secs', 'mfu', 'partitions_done', 'rows_per_sec',
  'output_tokens_per_sec', 'errors', 'retries'];

function chart(name, points) {
  const xs = points.map((p) => p.step);
  const ys = points.map((p) => p.values[name]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  let [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  if (y0 === y1) { y0 -= 1; y1 += 1; }
  const sx = (x) => (x1 === x0 ? 50 : ((x - x0) / (x1 - x0)) * 100);
  const sy = (y) => 100 - ((y - y0) / (y1 - y0)) * 100;
  const plot = svg('svg', { viewBox: '0 0 100 100', preserveAspectRatio: 'none', role: 'img' });
  const line = svg('polyline', { points: points.map((p, i) => `${sx(xs[i]).toFixed(3)},${sy(ys[i]).toFixed(3)}`).join(' ') });
  plot.append(line);
  return el('div', { class: 'chart', 'data-series': name, 'data-points': points.length },
    el('div', {}, el('span', { class: 'title' }, name), ' ', el('span', { class: 'muted' }, `latest ${fmtNumber(ys[ys.length - 1])}`)),
    el('div', { class: 'muted' }, `max ${fmtNumber(y1)}`),
    plot,
    el('div', { class: 'muted' }, `min ${fmtNumber(y0)} · step ${x0} to ${x1}`));
}

async function updateRun(name) {
  const run = await api(`/api/runs/${encodeURIComponent(name)}`);
  const names = new Set(run.points.flatMap((p) => Object.keys(p.values)));
  const ordered = [...SERIES_ORDER.filter((n) => names.has(n)), ...[...names].filter((n) => !SERIES_ORDER.includes(n)).sort()];
  const s = run.summary;
  replace($('#run'),
    facts([
      ['Kind', s.kind],
      ['Job', s.job ? el('a', { href: `#/job/${encodeURIComponent(s.job)}` }, s.job) : '—'],
      ['Step', el('span', { id: 'run-step' }, s.step)],
      ['Duration', fmtSeconds(s.duration_s)],
      ['State', s.finished ? 'finished' : `reported ${fmtSeconds(s.idle_s)} ago`],
    ]),
    el('h2', {}, 'Charts'),
    el('div', { class: 'charts' }, ordered.map((n) => chart(n, run.points.filter((p) => n in p.values)))));
}

// ---- start -------------------------------------------------------------------------------

document.addEventListener('DOMContentLoaded', () => {
  $('#login-form').addEventListener('submit', signIn);
  $('#logout').addEventListener('click', logOut);
  window.addEventListener('hashchange', route);
  // A session cookie from an earlier sign-in (this tab or another) opens the page at once.
  api('/api/cluster').then(start, () => { if (!ui.signedIn) signOut(''); });
});
