// A token transformer in JavaScript with state and flush: masks listed words
// in the streamed answer, even when a word arrives split across tokens. It
// holds back the last, possibly unfinished word of each step and emits it
// with the next one, or at the end of the stream (flush).
//
// Configuration: {"words": ["darn", "heck"], "mask": "*"}
import { Filter, TokenTransform, exportFilter } from './shallot.js';

const escape = (word) => word.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');

class Masker extends TokenTransform {
  constructor(config) {
    super();
    this.config = config;
    this.held = '';
  }

  masked(text) {
    const { pattern, mask } = this.config;
    return pattern ? text.replace(pattern, (word) => mask.repeat(word.length)) : text;
  }

  step(tokens, out) {
    for (const token of tokens) {
      const text = this.held + token.text;
      // Everything up to the last word boundary is final; the rest may still grow.
      const cut = Math.max(text.lastIndexOf(' '), text.lastIndexOf('\n')) + 1;
      this.held = text.slice(cut);
      if (cut) out.push(this.masked(text.slice(0, cut)), token.meta);
    }
  }

  flush(out) {
    if (this.held) out.push(this.masked(this.held));
    this.held = '';
  }
}

class WordMask extends Filter {
  static filterName = 'word-mask-js';

  constructor(config) {
    super(config);
    const c = config ?? {};
    const unknown = Object.keys(c).filter((k) => !['words', 'mask'].includes(k));
    if (unknown.length) throw new Error(`unknown option(s): ${unknown.join(', ')}`);
    const words = c.words ?? [];
    if (!words.every((w) => typeof w === 'string' && w)) throw new Error('words must be non-empty strings');
    this.mask = c.mask ?? '*';
    this.pattern = words.length ? new RegExp(`\\b(${words.map(escape).join('|')})\\b`, 'gi') : null;
  }

  tokenTransform() {
    return new Masker(this);
  }
}

exportFilter(WordMask);
export * from './shallot.js';
