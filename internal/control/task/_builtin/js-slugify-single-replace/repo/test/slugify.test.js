'use strict';

const test = require('node:test');
const assert = require('node:assert');
const { slugify } = require('../slugify.js');

test('two words become a slug', () => {
  assert.strictEqual(slugify('Hello World'), 'hello-world');
  assert.strictEqual(slugify('ALLCAPS'), 'allcaps');
});

test('accents are removed', () => {
  assert.strictEqual(slugify('Crème'), 'creme');
  assert.strictEqual(slugify('Ångström units'), 'angstrom-units');
});

test('custom separator', () => {
  assert.strictEqual(slugify('foo bar', { separator: '_' }), 'foo_bar');
  assert.strictEqual(slugify('foo.bar', { separator: '.' }), 'foo.bar');
});

test('every run of punctuation and spaces becomes one separator', () => {
  assert.strictEqual(slugify('Crème Brûlée: a recipe'), 'creme-brulee-a-recipe');
  assert.strictEqual(slugify('Node.js & Go, side by side'), 'node-js-go-side-by-side');
});

test('leading and trailing junk is trimmed', () => {
  assert.strictEqual(slugify('  -- Release notes (v2) --  '), 'release-notes-v2');
});

test('maxLength cuts at a word boundary', () => {
  assert.strictEqual(slugify('the-quick-brown-fox', { maxLength: 12 }), 'the-quick');
});
