// klein serve's web page. It uses the server's routes only: GET /v1/models (what the model allows),
// GET /v1/klein/loras, POST /v1/klein/generate/stream (server-sent events), DELETE
// /v1/klein/jobs/{id}. Results are kept in this browser (IndexedDB), never on the server.
'use strict';

const $ = (id) => document.getElementById(id);
const KEY_STORE = 'klein.apiKey';
const HISTORY_LIMIT = 200;

const state = {
  key: localStorage.getItem(KEY_STORE) || '',
  caps: null, // the model object's `klein` fields
  refs: [], // {file, url}
  source: null, // {file, url}
  run: null, // {controller, id, step, total, cancelled}
};

// ---- The API ----

class ApiError extends Error {
  constructor(error, status) {
    super(error.message || `HTTP ${status}`);
    this.param = error.param || null;
    this.type = error.type || null;
    this.status = status;
  }
}

async function api(path, options = {}) {
  const headers = new Headers(options.headers || {});
  if (state.key) headers.set('Authorization', `Bearer ${state.key}`);
  const response = await fetch(path, { ...options, headers });
  if (response.ok) return response;
  let error = { message: `${response.status} ${response.statusText}` };
  try {
    error = (await response.json()).error || error;
  } catch (_) { /* not JSON: keep the status line */ }
  if (response.status === 401) askKey(error.message);
  throw new ApiError(error, response.status);
}

// Server-sent events from a fetch body (the stream route is a POST, which EventSource cannot send).
async function* events(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, '\n');
    let end;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let name = 'message';
      const data = [];
      for (const line of block.split('\n')) {
        if (line.startsWith('event:')) name = line.slice(6).trim();
        else if (line.startsWith('data:')) data.push(line.slice(5).replace(/^ /, ''));
      }
      if (data.length) yield { name, data: JSON.parse(data.join('\n')) };
    }
  }
}

// ---- The API key ----

function askKey(message) {
  const dialog = $('key-dialog');
  $('key-message').textContent = state.key
    ? `The server refused this key: ${message}`
    : 'This server asks for an API key (klein serve --api-key).';
  $('key-button').hidden = false;
  if (!dialog.open) dialog.showModal();
  $('api-key').focus();
}

$('key-form').addEventListener('submit', () => {
  state.key = $('api-key').value.trim();
  localStorage.setItem(KEY_STORE, state.key);
  $('api-key').value = '';
  connect();
});
$('key-button').addEventListener('click', () => askKey(''));

// ---- What the model allows ----

const PRESETS = [
  ['default', 'Model default'],
  ['1024x1024', 'Square 1024 × 1024'],
  ['1152x864', 'Landscape 4:3, 1152 × 864'],
  ['864x1152', 'Portrait 3:4, 864 × 1152'],
  ['1360x768', 'Wide 16:9, 1360 × 768'],
  ['768x1360', 'Tall 9:16, 768 × 1360'],
  ['512x512', 'Small 512 × 512'],
  ['custom', 'Custom'],
];

async function connect() {
  try {
    const models = await (await api('/v1/models')).json();
    const model = models.data[0];
    state.caps = model.klein;
    $('model-name').textContent = model.id;
    showCaps();
    await loadLoras();
    pollReady();
  } catch (error) {
    setStatus(error.status === 401 ? 'needs an API key' : `cannot reach the server: ${error.message}`);
  }
}

function showCaps() {
  const caps = state.caps;
  $('negative-field').hidden = !caps.guidance;
  $('guidance-field').hidden = !caps.guidance;
  $('guidance').placeholder = caps.default_guidance;
  $('steps').placeholder = caps.default_steps;
  $('steps').max = caps.max_steps;
  $('num-images').max = caps.max_images;
  $('refs-count').textContent = `(up to ${caps.max_references})`;
  const select = $('size-preset');
  if (!select.options.length) {
    for (const [value, text] of PRESETS) select.add(new Option(text, value));
  }
  select.options[0].text = `Model default (${caps.default_width} × ${caps.default_height}, or the source's)`;
  const multiple = caps.pixel_multiple;
  $('width').step = multiple;
  $('height').step = multiple;
  showSizeNote();
}

async function loadLoras() {
  const { loras } = await (await api('/v1/klein/loras')).json();
  const list = $('loras-list');
  list.replaceChildren();
  $('loras-field').hidden = loras.length === 0;
  loras.forEach((name, i) => {
    const item = document.createElement('li');
    item.innerHTML = `<label class="inline"><input type="checkbox" id="lora-${i}"> <span></span></label>
      <label class="inline">scale <input type="number" step="0.05" value="1" id="lora-scale-${i}"></label>`;
    item.querySelector('span').textContent = name;
    item.dataset.name = name;
    list.append(item);
  });
}

async function pollReady() {
  for (;;) {
    try {
      const response = await fetch('/readyz');
      const body = await response.json();
      setStatus(body.status, body.status === 'ready');
      if (body.status === 'ready') return;
    } catch (_) {
      setStatus('server unreachable');
    }
    await new Promise((resolve) => setTimeout(resolve, 2000));
  }
}

function setStatus(text, ready = false) {
  const status = $('server-status');
  status.textContent = text;
  status.classList.toggle('ready', ready);
}

// ---- The form ----

function mode() {
  return document.querySelector('input[name=mode]:checked').value;
}

function showMode() {
  const inpaint = mode() === 'inpaint';
  $('inpaint-field').hidden = !inpaint;
  $('refs-field').hidden = inpaint;
}
for (const radio of document.querySelectorAll('input[name=mode]')) radio.addEventListener('change', showMode);

$('size-preset').addEventListener('change', () => {
  const custom = $('size-preset').value === 'custom';
  $('custom-size').hidden = !custom;
  if (custom && !$('width').value) {
    $('width').value = state.caps.default_width;
    $('height').value = state.caps.default_height;
  }
  showSizeNote();
});
$('width').addEventListener('input', showSizeNote);
$('height').addEventListener('input', showSizeNote);

// The floor the server applies, shown as the user types (the server says it again in `warnings`).
function showSizeNote() {
  const multiple = state.caps ? state.caps.pixel_multiple : 16;
  let note = `Sides are floored to a multiple of ${multiple}.`;
  if ($('size-preset').value === 'custom') {
    const w = Number($('width').value);
    const h = Number($('height').value);
    if (w > 0 && h > 0 && (w % multiple || h % multiple)) {
      note += ` ${w} × ${h} gives ${w - (w % multiple)} × ${h - (h % multiple)}.`;
    }
  }
  $('size-note').textContent = note;
}

$('strength').addEventListener('input', () => {
  $('strength-value').textContent = Number($('strength').value).toFixed(2);
});

function numberOf(id) {
  const text = $(id).value.trim();
  return text === '' ? undefined : Number(text);
}

// The form as the native route's body, without the images.
function settings() {
  const body = { prompt: $('prompt').value };
  const preset = $('size-preset').value;
  if (preset === 'custom') {
    body.width = numberOf('width');
    body.height = numberOf('height');
  } else if (preset !== 'default') {
    [body.width, body.height] = preset.split('x').map(Number);
  }
  body.steps = numberOf('steps');
  body.num_images = numberOf('num-images');
  if ($('seed-lock').checked) body.seed = numberOf('seed');
  if (state.caps && state.caps.guidance) {
    body.guidance = numberOf('guidance');
    const negative = $('negative').value;
    if (negative) body.negative_prompt = negative;
  }
  body.loras = [...$('loras-list').children]
    .filter((item) => item.querySelector('input[type=checkbox]').checked)
    .map((item) => `${item.dataset.name}:${item.querySelector('input[type=number]').value}`);
  for (const key of Object.keys(body)) if (body[key] === undefined) delete body[key];
  return body;
}

function fileBase64(blob) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result.slice(reader.result.indexOf(',') + 1));
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(blob);
  });
}

// ---- References ----

function addRefs(files) {
  for (const file of files) {
    if (!file.type.startsWith('image/')) continue;
    state.refs.push({ file, url: URL.createObjectURL(file) });
  }
  showRefs();
}

function showRefs() {
  const list = $('refs-list');
  list.replaceChildren();
  state.refs.forEach((ref, i) => {
    const item = document.createElement('li');
    const img = document.createElement('img');
    img.src = ref.url;
    img.alt = `Reference ${i + 1}: ${ref.file.name}`;
    const remove = document.createElement('button');
    remove.type = 'button';
    remove.textContent = '×';
    remove.setAttribute('aria-label', `Remove reference ${ref.file.name}`);
    remove.addEventListener('click', () => {
      URL.revokeObjectURL(ref.url);
      state.refs.splice(i, 1);
      showRefs();
    });
    item.append(img, remove);
    list.append(item);
  });
  const max = state.caps ? state.caps.max_references : 10;
  $('refs-count').textContent = `(${state.refs.length} of up to ${max})`;
}

$('refs-input').addEventListener('change', (event) => {
  addRefs(event.target.files);
  event.target.value = '';
});
const drop = $('refs-drop');
drop.addEventListener('dragover', (event) => {
  event.preventDefault();
  drop.classList.add('over');
});
drop.addEventListener('dragleave', () => drop.classList.remove('over'));
drop.addEventListener('drop', (event) => {
  event.preventDefault();
  drop.classList.remove('over');
  addRefs(event.dataTransfer.files);
});

// ---- Inpainting: the source and a painted mask (white repaints) ----

const canvas = $('mask-canvas');
const paint = canvas.getContext('2d');
let last = null;

$('source-input').addEventListener('change', (event) => {
  const file = event.target.files[0];
  if (!file) return;
  if (state.source) URL.revokeObjectURL(state.source.url);
  state.source = { file, url: URL.createObjectURL(file) };
  const img = $('source-image');
  img.onload = () => {
    canvas.width = img.naturalWidth;
    canvas.height = img.naturalHeight;
    $('mask-stage').hidden = false;
  };
  img.src = state.source.url;
});

function canvasPoint(event) {
  const rect = canvas.getBoundingClientRect();
  return {
    x: ((event.clientX - rect.left) * canvas.width) / rect.width,
    y: ((event.clientY - rect.top) * canvas.height) / rect.height,
  };
}

// The brush or the eraser, `width` screen pixels wide whatever the canvas's scale.
function pen() {
  const rect = canvas.getBoundingClientRect();
  const color = getComputedStyle(document.documentElement).getPropertyValue('--mask').trim() || '#ff2d6f';
  paint.globalCompositeOperation =
    document.querySelector('input[name=tool]:checked').value === 'eraser' ? 'destination-out' : 'source-over';
  paint.strokeStyle = color;
  paint.fillStyle = color;
  paint.lineWidth = (Number($('brush-size').value) * canvas.width) / rect.width;
  paint.lineCap = 'round';
  paint.lineJoin = 'round';
}

function stroke(from, to) {
  pen();
  paint.beginPath();
  paint.moveTo(from.x, from.y);
  paint.lineTo(to.x, to.y);
  paint.stroke();
}

// A click paints (or erases) a disc.
function dot(at) {
  pen();
  paint.beginPath();
  paint.arc(at.x, at.y, paint.lineWidth / 2, 0, 2 * Math.PI);
  paint.fill();
}

canvas.addEventListener('pointerdown', (event) => {
  canvas.setPointerCapture(event.pointerId);
  last = canvasPoint(event);
  dot(last);
});
canvas.addEventListener('pointermove', (event) => {
  if (!last) return;
  const point = canvasPoint(event);
  stroke(last, point);
  last = point;
});
for (const name of ['pointerup', 'pointercancel']) canvas.addEventListener(name, () => { last = null; });
$('mask-clear').addEventListener('click', () => paint.clearRect(0, 0, canvas.width, canvas.height));

// The painted strokes as the mask the API takes: white where painted, black elsewhere.
function maskBlob() {
  const white = document.createElement('canvas');
  white.width = canvas.width;
  white.height = canvas.height;
  const w = white.getContext('2d');
  w.drawImage(canvas, 0, 0);
  w.globalCompositeOperation = 'source-in';
  w.fillStyle = '#fff';
  w.fillRect(0, 0, white.width, white.height);
  const mask = document.createElement('canvas');
  mask.width = canvas.width;
  mask.height = canvas.height;
  const m = mask.getContext('2d');
  m.fillStyle = '#000';
  m.fillRect(0, 0, mask.width, mask.height);
  m.drawImage(white, 0, 0);
  return new Promise((resolve) => mask.toBlob(resolve, 'image/png'));
}

// ---- Errors next to their fields ----

const ERROR_SLOTS = [
  [/^prompt$/, 'err-prompt', 'prompt'],
  [/^negative_prompt$/, 'err-negative', 'negative'],
  [/^(size|width|height)$/, 'err-size', 'size-preset'],
  [/^steps$/, 'err-steps', 'steps'],
  [/^guidance$/, 'err-guidance', 'guidance'],
  [/^seed$/, 'err-seed', 'seed'],
  [/^(num_images|n)$/, 'err-num-images', 'num-images'],
  [/^refs/, 'err-refs', 'refs-input'],
  [/^(image|mask|strength|padding_mask_crop)/, 'err-inpaint', 'source-input'],
  [/^loras/, 'err-loras', null],
];

function clearErrors() {
  for (const el of document.querySelectorAll('.field-error')) {
    el.hidden = true;
    el.textContent = '';
  }
  for (const el of document.querySelectorAll('[aria-invalid]')) el.removeAttribute('aria-invalid');
}

function showError(error) {
  const slot = ERROR_SLOTS.find(([pattern]) => error.param && pattern.test(error.param));
  const target = slot ? $(slot[1]) : $('run-error');
  target.textContent = error.message;
  target.hidden = false;
  if (slot && slot[2]) {
    let input = $(slot[2]);
    if (slot[1] === 'err-size' && $('size-preset').value === 'custom') {
      input = $(error.param === 'height' ? 'height' : 'width');
    }
    input.setAttribute('aria-invalid', 'true');
    if (input.offsetParent) input.focus();
  }
}

// ---- A run ----

function setRunning(running) {
  $('generate').disabled = running;
  $('cancel').disabled = !running;
  $('progress-box').hidden = !running && !$('progress-text').textContent;
}

function progress(text, value) {
  $('progress-box').hidden = false;
  $('progress-text').textContent = text;
  if (value !== undefined) $('progress').value = value;
}

async function generate() {
  if (state.run) return;
  clearErrors();
  $('warnings').replaceChildren();
  const body = settings();
  const run = { controller: new AbortController(), id: null, step: 0, total: 0, cancelled: false };
  state.run = run;
  setRunning(true);
  progress('sending', 0);
  try {
    if (mode() === 'inpaint') {
      if (!state.source) throw new ApiError({ message: 'choose a source image to inpaint', param: 'image' }, 0);
      body.image = { name: state.source.file.name, data: await fileBase64(state.source.file) };
      body.mask = { name: 'mask.png', data: await fileBase64(await maskBlob()) };
      body.strength = Number($('strength').value);
    } else if (state.refs.length) {
      body.refs = await Promise.all(
        state.refs.map(async (ref) => ({ name: ref.file.name, data: await fileBase64(ref.file) })),
      );
    }
    body.preview_every = 1;
    const response = await api('/v1/klein/generate/stream', {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify(body),
      signal: run.controller.signal,
    });
    for await (const event of events(response)) {
      if (handle(run, event, body)) break;
    }
  } catch (error) {
    if (run.cancelled) progress(`cancelled at step ${run.step}/${run.total || '?'}`);
    else if (error.name === 'AbortError') progress('stopped');
    else {
      showError(error);
      progress('failed');
    }
  } finally {
    state.run = null;
    setRunning(false);
  }
}

// One event of the stream; true when it is the last.
function handle(run, { name, data }, body) {
  switch (name) {
    case 'queued':
      run.id = data.id;
      progress(data.ahead > 0 ? `waiting: ${data.ahead} ahead in the queue` : 'queued', 0);
      return false;
    case 'started':
      progress('started', 0);
      return false;
    case 'stage':
      if (data.state === 'started') progress(`${data.stage}…`);
      return false;
    case 'step':
      run.step = data.step;
      run.total = data.total;
      progress(`step ${data.step}/${data.total}`, data.step / data.total);
      return false;
    case 'preview':
      $('preview').src = `data:image/png;base64,${data.images[0]}`;
      $('preview-box').hidden = false;
      $('preview-box').dataset.step = data.step;
      return false;
    case 'done':
      done(data, body);
      return true;
    case 'error':
      if (data.error && data.error.type === 'cancelled') {
        progress(`cancelled at step ${run.step}/${run.total || '?'}`);
      } else {
        showError(data.error || { message: 'the server stopped the request' });
        progress('failed');
      }
      return true;
    default:
      return false;
  }
}

function done(answer, body) {
  progress(`done in ${Object.values(answer.timings || {}).reduce((a, b) => a + b, 0).toFixed(1)} s`, 1);
  $('preview-box').hidden = true;
  $('seed').value = answer.seed;
  for (const warning of answer.warnings || []) {
    const item = document.createElement('li');
    item.textContent = warning;
    $('warnings').append(item);
  }
  const params = { ...body };
  delete params.image;
  delete params.mask;
  delete params.refs;
  delete params.preview_every;
  params.seed = answer.seed;
  params.mode = mode();
  const entry = {
    id: answer.id,
    created: Date.now(),
    params,
    result: { seed: answer.seed, width: answer.width, height: answer.height, steps: answer.steps,
              guidance: answer.guidance, warnings: answer.warnings },
    images: answer.images.map((b64) => new Blob([Uint8Array.from(atob(b64), (c) => c.charCodeAt(0))],
                                                 { type: 'image/png' })),
  };
  saveResult(entry).catch((error) => console.warn('history not saved', error));
  $('gallery').prepend(card(entry));
}

async function cancel() {
  const run = state.run;
  if (!run) return;
  run.cancelled = true;
  $('cancel').disabled = true;
  progress(`cancelling at step ${run.step}/${run.total || '?'}…`);
  try {
    if (run.id) await api(`/v1/klein/jobs/${encodeURIComponent(run.id)}`, { method: 'DELETE' });
  } catch (_) { /* already finished: the stream says how */ }
  run.controller.abort();
}

$('form').addEventListener('submit', (event) => {
  event.preventDefault();
  generate();
});
$('cancel').addEventListener('click', cancel);
document.addEventListener('keydown', (event) => {
  if (event.key === 'Enter' && (event.ctrlKey || event.metaKey)) {
    event.preventDefault();
    generate();
  }
});

// ---- Results: kept in this browser ----

function database() {
  return new Promise((resolve, reject) => {
    const request = indexedDB.open('klein-web', 1);
    request.onupgradeneeded = () => request.result.createObjectStore('results', { keyPath: 'id' });
    request.onsuccess = () => resolve(request.result);
    request.onerror = () => reject(request.error);
  });
}

async function store(mode, work) {
  const db = await database();
  return new Promise((resolve, reject) => {
    const tx = db.transaction('results', mode);
    const result = work(tx.objectStore('results'));
    tx.oncomplete = () => resolve(result && result.result);
    tx.onerror = () => reject(tx.error);
  });
}

async function saveResult(entry) {
  await store('readwrite', (s) => s.put(entry));
  const all = await store('readonly', (s) => s.getAll());
  all.sort((a, b) => a.created - b.created);
  const extra = all.slice(0, Math.max(0, all.length - HISTORY_LIMIT));
  if (extra.length) await store('readwrite', (s) => extra.forEach((e) => s.delete(e.id)));
}

async function showHistory() {
  try {
    const all = await store('readonly', (s) => s.getAll());
    all.sort((a, b) => b.created - a.created);
    $('gallery').replaceChildren(...all.map(card));
  } catch (error) {
    console.warn('no history in this browser', error);
  }
}

function describe(params, result) {
  const parts = [`${result.width} × ${result.height}`, `${result.steps} steps`, `seed ${result.seed}`];
  if (params.guidance !== undefined) parts.push(`guidance ${params.guidance}`);
  if (params.num_images > 1) parts.push(`${params.num_images} images`);
  if (params.mode === 'inpaint') parts.push(`inpaint, strength ${params.strength}`);
  if (params.loras && params.loras.length) parts.push(`LoRAs ${params.loras.join(', ')}`);
  return parts.join(' · ');
}

function card(entry) {
  const item = document.createElement('li');
  item.className = 'card';
  item.dataset.id = entry.id;
  const { params, result } = entry;
  entry.images.forEach((blob, i) => {
    const url = URL.createObjectURL(blob);
    const img = document.createElement('img');
    img.src = url;
    img.alt = `Result: ${params.prompt || '(empty prompt)'}`;
    const link = document.createElement('a');
    link.href = url;
    link.download = entry.images.length > 1 ? `klein-${result.seed}-${i + 1}.png` : `klein-${result.seed}.png`;
    link.textContent = entry.images.length > 1 ? `Download ${i + 1}` : 'Download PNG';
    link.className = 'download';
    item.append(img, link);
  });
  const prompt = document.createElement('p');
  prompt.className = 'prompt';
  prompt.textContent = params.prompt || '(empty prompt)';
  const info = document.createElement('p');
  info.className = 'params';
  info.textContent = describe(params, result);
  const actions = document.createElement('div');
  actions.className = 'row';
  const reuse = document.createElement('button');
  reuse.type = 'button';
  reuse.className = 'reuse';
  reuse.textContent = 'Reuse settings';
  reuse.addEventListener('click', () => applySettings(params));
  const remove = document.createElement('button');
  remove.type = 'button';
  remove.textContent = 'Delete';
  remove.setAttribute('aria-label', 'Delete this result');
  remove.addEventListener('click', async () => {
    await store('readwrite', (s) => s.delete(entry.id));
    item.remove();
  });
  actions.append(reuse, remove);
  item.append(prompt, info, actions);
  return item;
}

function applySettings(params) {
  $('prompt').value = params.prompt || '';
  $('negative').value = params.negative_prompt || '';
  const size = params.width && params.height ? `${params.width}x${params.height}` : 'default';
  const preset = PRESETS.some(([value]) => value === size) ? size : 'custom';
  $('size-preset').value = preset;
  $('custom-size').hidden = preset !== 'custom';
  $('width').value = preset === 'custom' ? params.width : '';
  $('height').value = preset === 'custom' ? params.height : '';
  $('steps').value = params.steps ?? '';
  $('guidance').value = params.guidance ?? '';
  $('num-images').value = params.num_images ?? 1;
  $('seed').value = params.seed;
  $('seed-lock').checked = true;
  if (params.strength !== undefined) {
    $('strength').value = params.strength;
    $('strength-value').textContent = Number(params.strength).toFixed(2);
  }
  const scales = new Map((params.loras || []).map((l) => [l.slice(0, l.lastIndexOf(':')), l.slice(l.lastIndexOf(':') + 1)]));
  for (const item of $('loras-list').children) {
    item.querySelector('input[type=checkbox]').checked = scales.has(item.dataset.name);
    if (scales.has(item.dataset.name)) item.querySelector('input[type=number]').value = scales.get(item.dataset.name);
  }
  showSizeNote();
  $('prompt').focus();
}

$('clear-history').addEventListener('click', async () => {
  await store('readwrite', (s) => s.clear());
  $('gallery').replaceChildren();
});

showMode();
showHistory();
connect();
