// The IAM evaluator behind local/access/evaluator.py: a maintained simulator (@cloud-copilot/iam-simulate) judges
// each request exactly as given, one JSON object a line on stdin, one answer a line on stdout.
//
//   {"id": 1, "op": "load", "name": "tick", "identity": [{"name": ..., "policy": {...}}]}   -> {"id": 1, "ok": true}
//   {"id": 2, "op": "judge", "identity": "tick", "principal": "arn:...", "action": "s3:GetObject",
//    "resource": "arn:aws:s3:::b/k", "account": "123456789012", "context": {...}, "resourcePolicy": {...} | null}
//        -> {"id": 2, "result": "Allowed" | "ImplicitlyDenied" | "ExplicitlyDenied", "deniedBy": [sid, ...],
//            "errors": null | "..."}
'use strict'
const readline = require('readline')
const path = require('path')
const { runSimulation } = require('@cloud-copilot/iam-simulate')

// iam-simulate (0.1.173) splits the resource part of an ARN into a resource type and an id at its first '/' or ':'
// before it substitutes policy variables, also for services whose ARNs name the resource with no type (an SQS queue,
// an SNS topic). The '/' of a variable such as ${aws:PrincipalTag/participant} is then taken for that split, and
// arn:aws:sqs:<region>:<account>:fed-<run>-p-${aws:PrincipalTag/participant} never matches the session's own queue.
// IAM has no resource type there: this makes the split so for those two services; all matching stays the library's.
const util = require(path.join(path.dirname(require.resolve('@cloud-copilot/iam-simulate')), 'util.js'))
const splitResource = util.getResourceSegments
const UNTYPED = new Set(['sqs', 'sns'])
util.getResourceSegments = (resource) =>
  resource.isArnResource() && UNTYPED.has(resource.service()) ? ['', resource.resource()] : splitResource(resource)

const identities = new Map()

function sids(statements) {
  return (statements || []).map((s) => (s.statement && s.statement.Sid) || `#${s.statementIndex ?? '?'}`)
}

async function judge(msg) {
  const simulation = {
    request: {
      principal: msg.principal,
      action: msg.action,
      resource: { resource: msg.resource, accountId: msg.account },
      contextVariables: msg.context || {},
    },
    identityPolicies: identities.get(msg.identity) || [],
    serviceControlPolicies: [],
    resourceControlPolicies: [],
  }
  if (msg.resourcePolicy) simulation.resourcePolicy = msg.resourcePolicy
  const out = await runSimulation(simulation, {})
  if (out.resultType === 'error') {
    return { result: 'Error', errors: JSON.stringify(out.errors) }
  }
  const analysis = out.resultType === 'single' ? out.result.analysis : (out.results[0] || {}).analysis || {}
  const denied = [
    ...sids(analysis.identityAnalysis && analysis.identityAnalysis.denyStatements),
    ...sids(analysis.resourceAnalysis && analysis.resourceAnalysis.denyStatements),
  ]
  return { result: out.overallResult, deniedBy: denied, errors: null }
}

const rl = readline.createInterface({ input: process.stdin, terminal: false })
let queue = Promise.resolve()
rl.on('line', (line) => {
  // answered in order: each request waits for the one before it
  queue = queue.then(async () => {
    let msg
    try {
      msg = JSON.parse(line)
    } catch (err) {
      process.stdout.write(JSON.stringify({ id: null, result: 'Error', errors: String(err) }) + '\n')
      return
    }
    let answer
    try {
      if (msg.op === 'load') {
        identities.set(msg.name, msg.identity)
        answer = { ok: true }
      } else {
        answer = await judge(msg)
      }
    } catch (err) {
      answer = { result: 'Error', errors: String((err && err.stack) || err) }
    }
    process.stdout.write(JSON.stringify({ id: msg.id, ...answer }) + '\n')
  })
})
rl.on('close', () => queue.then(() => process.exit(0)))
