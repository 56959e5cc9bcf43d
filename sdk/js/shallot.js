// shallot-filter: write a shallot filter in JavaScript.
//
// Extend `Filter`, override the hooks you need (the others pass through and
// are never called), name it with `exportFilter`, and re-export this module
// (which holds the component's interfaces):
//
//   import { Filter, FilterError, exportFilter, next, textOf } from './shallot.js';
//
//   class Guard extends Filter {
//     static filterName = 'guard';
//     constructor(config) { super(config); this.word = config?.word ?? 'secret'; }
//     aroundChat(request, fctx) {
//       if (request.messages().some((m) => textOf(m).includes(this.word))) {
//         throw new FilterError('content-filtered', 'blocked');
//       }
//       return next.chat(request);
//     }
//   }
//
//   exportFilter(Guard);
//   export * from './shallot.js';
//
// Build with componentize-js against shallot's wit/ (see docs/book/writing-filters-javascript.md), with
// this file beside app.js. A hook gets the host-owned request and the
// filter's private context `fctx`; JSON values travel as JS values. Throw
// `FilterError` to fail a request on purpose; any other exception fails it
// as a `plugin-fault` carrying the exception's message and stack.

import * as wnext from 'shallot:filter/next@0.1.5';
import * as wfctx from 'shallot:filter/fctx@0.1.5';
import * as wcontext from 'shallot:filter/context@0.1.5';
import * as wkv from 'shallot:filter/kv@0.1.5';
import * as wmetrics from 'shallot:filter/metrics@0.1.5';
import * as wmodel from 'shallot:filter/model@0.1.5';
import { log as wlog } from 'shallot:filter/log@0.1.5';
import { ChatResponse } from 'shallot:filter/types@0.1.5';

/** A typed failure: `kind` is transient, timeout, content-filtered,
 * invalid-request, auth, not-found, limit-exceeded, plugin-fault or internal. */
export class FilterError extends Error {
  constructor(kind, message) {
    super(`${kind}: ${message}`);
    this.kind = kind;
    this.detail = message;
  }
}

// Calls through `next` in the current hook call, counted as the host counts
// them; the inner failures they raised and the failed turn results they
// returned, by call, so that one handed back unchanged keeps its origin.
let calls = 0;
const innerErrors = new Map();
const turnErrors = new Map();

function beginHook() {
  calls = 0;
  innerErrors.clear();
  turnErrors.clear();
}

function inner(call) {
  const nth = ++calls;
  try {
    return call();
  } catch (e) {
    if (e && e.payload && e.payload.kind) {
      const error = new FilterError(e.payload.kind, e.payload.message);
      innerErrors.set(error, { nth, kind: error.kind, detail: error.detail });
      throw error;
    }
    throw e;
  }
}

function innerTurn(call) {
  const nth = ++calls;
  const result = call();
  if (result.tag === 'error') turnErrors.set(result, nth);
  return result;
}

/** The inner layers. An inner failure throws `FilterError`; rethrown
 * unchanged, it keeps its origin (the filter or terminal that failed). */
export const next = {
  chat: (request, timeoutMs) =>
    inner(() => (timeoutMs === undefined ? wnext.chat(request) : wnext.chatWithin(request, timeoutMs))),
  tool: (request, timeoutMs) =>
    inner(() => (timeoutMs === undefined ? wnext.tool(request) : wnext.toolWithin(request, timeoutMs))),
  /** Turn results ({tag: 'done' | 'interrupt' | 'error', val}) are values, never thrown. */
  turn: (request, timeoutMs) =>
    innerTurn(() => (timeoutMs === undefined ? wnext.turn(request) : wnext.turnWithin(request, timeoutMs))),
};

/** The invoke's shared context: JSON values by key, seen by every filter. */
export const context = {
  get(key, fallback = undefined) {
    const value = wcontext.get(key);
    return value === undefined ? fallback : JSON.parse(value);
  },
  set: (key, value) => wcontext.set(key, JSON.stringify(value)),
  remove: (key) => wcontext.remove(key),
  keys: () => wcontext.keys(),
};

function granted(call) {
  try {
    return call();
  } catch (e) {
    if (e && e.payload && e.payload.kind) throw new FilterError(e.payload.kind, e.payload.message);
    throw e;
  }
}

/** Shared state kept across invokes (granted by `grants.kv`): keys in this
 * filter's namespace, in the store the operator chose (in-process, an SQLite
 * file, or a Redis several hosts share). A key is 1 to 512 bytes, a value at
 * most 1 MiB; a `ttlMs` of 0 keeps a key until it is deleted. A refusal, or a
 * store that fails, throws `FilterError`. */
export const kv = {
  /** `{ value, version }`, or null for a key never written, deleted or expired. */
  get(key) {
    const entry = granted(() => wkv.get(key));
    return entry === undefined ? null : { value: entry.value, version: Number(entry.version) };
  },
  /** Writes `value`; its new version. */
  set: (key, value, ttlMs = 0) => Number(granted(() => wkv.set(key, value, BigInt(ttlMs)))),
  /** Writes `value` only if the key is still at `version` (0: absent),
   * atomically: the new version, or null with nothing written. */
  swap(key, value, version, ttlMs = 0) {
    const written = granted(() => wkv.swap(key, value, BigInt(version), BigInt(ttlMs)));
    return written === undefined ? null : Number(written);
  },
  /** Adds `delta` to the counter atomically (absent: 0); a counter this
   * creates lives `ttlMs`. `{ value, ttlMs }`: the count and its time left. */
  add(key, delta = 1, ttlMs = 0) {
    const count = granted(() => wkv.add(key, BigInt(delta), BigInt(ttlMs)));
    return { value: Number(count.value), ttlMs: Number(count.ttlMs) };
  },
  /** Forgets the key; whether it was there. */
  delete: (key) => granted(() => wkv.delete(key)),
  /** Counts in several windows at once, all or nothing, on the store's clock:
   * each window's `amount` is added only if none had counted its `limit` yet.
   * A window is `{ key, period, limit, amount }`, its period `{ fixed: ms }`,
   * `{ sliding: ms }`, `{ aligned: ms }` or `'month'`. `{ admitted, windows:
   * [{ used, resetMs, endsMs }] }`. */
  take(windows) {
    const taken = granted(() =>
      wkv.take(
        windows.map((w) => ({
          key: w.key,
          period: period(w.period),
          limit: BigInt(w.limit),
          amount: BigInt(w.amount ?? 1),
        })),
      ),
    );
    return {
      admitted: taken.admitted,
      windows: taken.windows.map((seen) => ({
        used: Number(seen.used),
        resetMs: Number(seen.resetMs),
        endsMs: Number(seen.endsMs),
      })),
    };
  },
  /** Adds `delta` to the counter of the window a take saw end at `endsMs`,
   * only while it lives and never below 0: the counter after, or null when
   * the window had ended. */
  settle(key, windowPeriod, endsMs, delta) {
    const after = granted(() => wkv.settle(key, period(windowPeriod), BigInt(endsMs), BigInt(delta)));
    return after === undefined ? null : Number(after);
  },
};

/** A window's period as the host takes it. */
function period(p) {
  if (p === 'month') return { tag: 'month' };
  const [tag, ms] = Object.entries(p)[0];
  return { tag, val: BigInt(ms) };
}

/** Counters and histograms of the filter's own, on the gateway's
 * `/metrics` as `shallot_gateway_plugin_<filter>__<name>` (no grant
 * needed). A metric keeps the kind and label names of its first use; at
 * most 32 metrics, 4 labels and 64 series a metric (more series count in
 * the one labelled `other`). A refusal throws `FilterError`. */
export const metrics = {
  /** Adds `value` to the counter `name` in the series `labels` (an object). */
  count: (name, labels = {}, value = 1) => granted(() => wmetrics.count(name, Object.entries(labels), BigInt(value))),
  /** Records `value` in the histogram `name` (buckets 0.005 to 10). */
  observe: (name, value, labels = {}) => granted(() => wmetrics.observe(name, Object.entries(labels), value)),
};

/** Side calls to the model the operator grants (`grants.model`), outside
 * the onion: no filter sees them, nothing of them is streamed. Bounded per
 * hook call in calls and tokens (`limit-exceeded` past either). */
export const model = {
  /** The granted model's answer to `request` (a `ChatRequest`). */
  complete: (request) => granted(() => wmodel.complete(request)),
};

/** The filter's private context in the current invoke: one JSON value, the
 * same in its around-turn, around-chat and around-tool. */
export const fctx = {
  get: () => JSON.parse(wfctx.get()),
  set: (state) => wfctx.set(JSON.stringify(state)),
  update(change) {
    const state = change(this.get());
    this.set(state);
    return state;
  },
};

/** Log lines, attributed to the filter by the host. */
export const log = Object.fromEntries(
  ['trace', 'debug', 'info', 'warn', 'error'].map((level) => [level, (message) => wlog(level, String(message))]),
);

/** An assistant message with `text`. */
export function assistant(text) {
  return { role: 'assistant', content: { tag: 'text', val: text }, toolCalls: [] };
}

/** A response with `text`, for a filter that answers itself (a refusal, a
 * cached answer) instead of calling `next.chat`; `finishReason` is
 * 'complete' unless given ('content-filtered', 'length-limit', ...). */
export function answer(text, finishReason = 'complete') {
  return new ChatResponse(assistant(text), finishReason);
}

/** A message's text, parts joined. */
export function textOf(message) {
  const content = message.content;
  if (!content) return '';
  if (content.tag === 'text') return content.val;
  return content.val
    .filter((part) => part.tag === 'text')
    .map((part) => part.val)
    .join('');
}

const encoder = new TextEncoder();
const decoder = new TextDecoder();

/** What a token transform emits: tokens, each with optional metadata (a JSON object as text). */
export class TokenOut {
  #text = '';
  #length = 0;
  #ends = [];
  #metas = [];

  push(text, meta = undefined) {
    if (meta !== undefined && meta !== null) this.#metas.push({ index: this.#ends.length, json: meta });
    this.#text += text;
    this.#length += encoder.encode(text).length;
    this.#ends.push(this.#length);
  }

  batch() {
    return { text: this.#text, ends: this.#ends, metas: this.#metas };
  }
}

// `ends` are UTF-8 byte offsets, so the text is sliced as bytes.
function tokensOf(batch) {
  const raw = encoder.encode(batch.text);
  const metas = new Map(batch.metas.map((m) => [m.index, m.json]));
  const tokens = [];
  let start = 0;
  for (let i = 0; i < batch.ends.length; i++) {
    tokens.push({ text: decoder.decode(raw.subarray(start, batch.ends[i])), meta: metas.get(i) });
    start = batch.ends[i];
  }
  return tokens;
}

/** One stream's token transform; keep per-stream state on `this`. */
export class TokenTransform {
  /** Takes the next tokens ({text, meta}) and emits 0..N for them. */
  step(tokens, out) {
    for (const { text, meta } of tokens) out.push(text, meta);
  }

  /** The stream ended normally: emit what is still buffered. Not called when it fails. */
  flush(out) {}
}

/** A shallot filter. The constructor gets the operator's configuration
 * (parsed JSON, `null` when none is given); throw to reject it. */
export class Filter {
  static filterName = 'filter';
  static version = '0.1.0';

  constructor(config) {}

  /** The private context's seed for every invoke. */
  initFctx() {
    return null;
  }

  /** Whether an overridden hook is live for this configuration. */
  wants(hook) {
    return true;
  }

  aroundChat(request, fctx) {
    return next.chat(request);
  }

  aroundTool(request, fctx) {
    return next.tool(request);
  }

  aroundTurn(request, fctx) {
    return next.turn(request);
  }

  systemPrompt(prompt) {
    return prompt;
  }

  /** A fresh transform for one stream. */
  tokenTransform() {
    return new TokenTransform();
  }
}

const HOOKS = {
  aroundChat: 'around-chat',
  aroundTool: 'around-tool',
  aroundTurn: 'around-turn',
  tokenTransform: 'token-transform',
  systemPrompt: 'system-prompt',
};

function asWitError(e) {
  if (e instanceof FilterError) {
    const seen = innerErrors.get(e);
    if (seen && seen.kind === e.kind && seen.detail === e.detail) wnext.passOn(seen.nth);
    return { kind: e.kind, message: e.detail };
  }
  return { kind: 'plugin-fault', message: `uncaught ${e && e.stack ? `${e}\n${e.stack}` : String(e)}` };
}

// Runs a hook. An async hook (one that awaits `fetch`, say) returns a
// promise, which componentize-js settles by running the event loop
// before the call returns to the host.
function guarded(call) {
  beginHook();
  try {
    const value = call();
    if (value instanceof Promise) {
      return value.catch((e) => {
        throw asWitError(e);
      });
    }
    return value;
  } catch (e) {
    throw asWitError(e);
  }
}

// The filter class `exportFilter` named, and its instance once configured.
let FilterClass = null;
let current = null;

/** Makes `filterClass` (a subclass of `Filter`) the component's filter.
 * Call it once in app.js, then re-export this module
 * (`export * from './shallot.js';`), which holds the interfaces below. */
export function exportFilter(filterClass) {
  FilterClass = filterClass;
}

function filter() {
  if (!current) throw new FilterError('internal', 'the host called a hook before configure');
  return current;
}

class TokenTransformer {
  #transform = filter().tokenTransform();

  step(batch) {
    const out = new TokenOut();
    guarded(() => this.#transform.step(tokensOf(batch), out));
    return out.batch();
  }

  flush() {
    const out = new TokenOut();
    guarded(() => this.#transform.flush(out));
    return out.batch();
  }
}

// The WIT interfaces the component exports, over the configured filter.

export const plugin = {
  configure(config) {
    if (!FilterClass) throw 'app.js names no filter: call exportFilter(YourFilter) in it';
    try {
      current = new FilterClass(JSON.parse(config));
    } catch (e) {
      throw String(e && e.message ? e.message : e);
    }
  },
  describe() {
    const f = filter();
    const hooks = Object.entries(HOOKS)
      .filter(([method, hook]) => f[method] !== Filter.prototype[method] && f.wants(hook))
      .map(([, hook]) => hook);
    return {
      name: FilterClass.filterName,
      version: FilterClass.version,
      initFctx: JSON.stringify(f.initFctx() ?? null),
      hooks,
    };
  },
};

export const chatFilter = {
  aroundChat: (request) => guarded(() => filter().aroundChat(request, fctx)),
};

export const toolFilter = {
  aroundTool: (request) => guarded(() => filter().aroundTool(request, fctx)),
};

export const turnFilter = {
  aroundTurn(request) {
    beginHook();
    try {
      const result = filter().aroundTurn(request, fctx);
      const nth = turnErrors.get(result);
      if (nth !== undefined) wnext.passOn(nth);
      return result;
    } catch (e) {
      return { tag: 'error', val: asWitError(e) };
    }
  },
};

export const systemPromptFilter = {
  systemPrompt: (prompt) => guarded(() => filter().systemPrompt(prompt)),
};

export const tokenFilter = { TokenTransformer };
