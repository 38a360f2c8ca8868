'use strict';

const test = require('node:test');
const assert = require('node:assert');
const semver = require('../semver.js');

test('parse reads all parts', () => {
  const v = semver.parse('v1.2.3-beta.2+build.5');
  assert.deepStrictEqual(v.prerelease, ['beta', '2']);
  assert.throws(() => semver.parse('1.2'), TypeError);
  assert.throws(() => semver.parse('one.two.three'), TypeError);
});

test('compare single-digit versions', () => {
  assert.strictEqual(semver.compare('1.2.3', '1.2.3'), 0);
  assert.strictEqual(semver.compare('1.2.3', '1.2.4'), -1);
  assert.strictEqual(semver.compare('2.0.0', '1.9.9'), 1);
  assert.strictEqual(semver.compare('v1.0.0', '1.0.0+meta'), 0);
});

test('pre-releases sort before the release', () => {
  assert.deepStrictEqual(
    semver.sort(['1.0.0', '1.0.0-rc.1', '1.0.0-alpha', '1.0.0-alpha.10', '1.0.0-alpha.2']),
    ['1.0.0-alpha', '1.0.0-alpha.2', '1.0.0-alpha.10', '1.0.0-rc.1', '1.0.0'],
  );
});

test('compare multi-digit components numerically', () => {
  assert.strictEqual(semver.compare('1.10.0', '1.9.0'), 1);
  assert.strictEqual(semver.compare('1.2.10', '1.2.9'), 1);
  assert.strictEqual(semver.compare('9.0.0', '10.0.0'), -1);
});

test('max picks the highest release', () => {
  assert.strictEqual(semver.max(['0.9.1', '0.10.0', '0.2.7']), '0.10.0');
});
