'use strict';

function escapeRegExp(s) {
  return s.replace(/[.*+?^${}()|[\]\\]/g, '\\$&');
}

/**
 * slugify('Crème Brûlée: a recipe') === 'creme-brulee-a-recipe'
 *
 * Options:
 *   separator  string placed between words (default '-')
 *   maxLength  cut the slug to at most this many characters, at a word
 *              boundary when possible (0 = no limit)
 */
function slugify(input, { separator = '-', maxLength = 0 } = {}) {
  const sep = escapeRegExp(separator);
  let slug = String(input)
    .normalize('NFKD')
    .replace(/[\u0300-\u036f]/g, '') // drop combining accents
    .toLowerCase()
    .replace(/[^a-z0-9]+/, separator)
    .replace(new RegExp(`^(?:${sep})+|(?:${sep})+$`, 'g'), '');

  if (maxLength > 0 && slug.length > maxLength) {
    slug = slug.slice(0, maxLength);
    const cut = slug.lastIndexOf(separator);
    if (cut > 0) slug = slug.slice(0, cut);
  }
  return slug;
}

module.exports = { slugify };
