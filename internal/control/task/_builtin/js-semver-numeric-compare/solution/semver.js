'use strict';

const VERSION_RE = /^v?(\d+)\.(\d+)\.(\d+)(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?(?:\+[0-9A-Za-z.-]+)?$/;

function parse(version) {
  const m = VERSION_RE.exec(String(version).trim());
  if (!m) throw new TypeError(`invalid version: ${version}`);
  return {
    major: Number(m[1]),
    minor: Number(m[2]),
    patch: Number(m[3]),
    prerelease: m[4] ? m[4].split('.') : [],
  };
}

function compareIdentifiers(a, b) {
  const an = /^\d+$/.test(a);
  const bn = /^\d+$/.test(b);
  if (an && bn) return Math.sign(Number(a) - Number(b));
  if (an) return -1; // numeric identifiers sort before alphanumeric ones
  if (bn) return 1;
  return a < b ? -1 : a > b ? 1 : 0;
}

// compare returns -1, 0 or 1 as version a is lower than, equal to or higher than b.
function compare(a, b) {
  const x = parse(a);
  const y = parse(b);
  for (const field of ['major', 'minor', 'patch']) {
    if (x[field] !== y[field]) return x[field] < y[field] ? -1 : 1;
  }
  // A version without a pre-release tag is higher than one with a tag.
  if (!x.prerelease.length || !y.prerelease.length) {
    return Math.sign(y.prerelease.length - x.prerelease.length);
  }
  const n = Math.max(x.prerelease.length, y.prerelease.length);
  for (let i = 0; i < n; i++) {
    if (x.prerelease[i] === undefined) return -1;
    if (y.prerelease[i] === undefined) return 1;
    const c = compareIdentifiers(x.prerelease[i], y.prerelease[i]);
    if (c !== 0) return c;
  }
  return 0;
}

function sort(versions) {
  return [...versions].sort(compare);
}

function max(versions) {
  return versions.reduce((best, v) => (best === undefined || compare(v, best) > 0 ? v : best), undefined);
}

module.exports = { parse, compare, sort, max };
