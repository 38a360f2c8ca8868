'use strict';

// decode turns one form-encoded component into text ('+' means space).
function decode(s) {
  return decodeURIComponent(s.replace(/\+/g, ' '));
}

/**
 * parse('?a=1&b=x+y&a=2') -> { a: ['1', '2'], b: 'x y' }
 * A key without '=' gets the empty string. Repeated keys collect into an array.
 */
function parse(query) {
  const out = {};
  let qs = String(query);
  if (qs.startsWith('?')) qs = qs.slice(1);
  qs = decode(qs);
  for (const part of qs.split('&')) {
    if (part === '') continue;
    const eq = part.indexOf('=');
    const key = eq === -1 ? part : part.slice(0, eq);
    const value = eq === -1 ? '' : part.slice(eq + 1);
    if (Object.prototype.hasOwnProperty.call(out, key)) {
      out[key] = [].concat(out[key], value);
    } else {
      out[key] = value;
    }
  }
  return out;
}

function encode(s) {
  return encodeURIComponent(s).replace(/%20/g, '+');
}

/**
 * stringify({ a: ['1', '2'], b: 'x y' }) -> 'a=1&a=2&b=x+y'
 * Keys are emitted in insertion order; undefined values are skipped.
 */
function stringify(obj) {
  const parts = [];
  for (const [key, value] of Object.entries(obj)) {
    if (value === undefined) continue;
    for (const v of [].concat(value)) {
      parts.push(`${encode(key)}=${encode(String(v))}`);
    }
  }
  return parts.join('&');
}

module.exports = { parse, stringify };
