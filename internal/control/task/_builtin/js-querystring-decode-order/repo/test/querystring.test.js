'use strict';

const test = require('node:test');
const assert = require('node:assert');
const qs = require('../querystring.js');

test('parse simple pairs', () => {
  assert.deepStrictEqual(qs.parse('?page=2&sort=name&flag'), { page: '2', sort: 'name', flag: '' });
  assert.deepStrictEqual(qs.parse(''), {});
});

test('parse repeated keys and plus signs', () => {
  assert.deepStrictEqual(qs.parse('tag=a&q=hello+world&tag=b'), { tag: ['a', 'b'], q: 'hello world' });
  assert.deepStrictEqual(qs.parse('name=J%C3%BCrgen'), { name: 'Jürgen' });
});

test('stringify encodes values', () => {
  assert.strictEqual(qs.stringify({ q: 'a b', tag: ['x', 'y'], skip: undefined }), 'q=a+b&tag=x&tag=y');
});

test('parse keeps encoded delimiters inside values', () => {
  assert.deepStrictEqual(qs.parse('q=rock%26roll&page=2'), { q: 'rock&roll', page: '2' });
  assert.deepStrictEqual(qs.parse('a%3Db=1%2B1'), { 'a=b': '1+1' });
});

test('stringify then parse round-trips', () => {
  const obj = { redirect: '/search?q=a&b=c', note: '50% off = deal', plus: 'c++' };
  assert.deepStrictEqual(qs.parse(qs.stringify(obj)), obj);
});
