#!lua
local p = ARGV[1]
local out = {}
for i = 2, #ARGV, 16 do
  local id = ARGV[i]
  if redis.call('SET', p .. 'req:' .. id, ARGV[i + 1], 'NX') then
    local inst, key, day, model, status = ARGV[i + 3], ARGV[i + 4], ARGV[i + 5], ARGV[i + 6], ARGV[i + 7]
    local d, prompt, engine, cached, compl, reason, billed, cost =
      ARGV[i + 8], ARGV[i + 9], ARGV[i + 10], ARGV[i + 11], ARGV[i + 12], ARGV[i + 13], ARGV[i + 14], ARGV[i + 15]
    redis.call('ZADD', p .. 'by_finished', ARGV[i + 2], id)
    if d ~= '' then  -- '' for health probes: not in the daily aggregates
      redis.call('HSET', d, 'api_key_id', key, 'day', day, 'model', model)
      redis.call('HINCRBY', d, 'requests', 1)
      redis.call('HINCRBY', d, 'prompt_tokens', prompt)
      redis.call('HINCRBY', d, 'cached_tokens', cached)
      redis.call('HINCRBY', d, 'completion_tokens', compl)
      redis.call('HINCRBY', d, 'billed_micro', billed)
      redis.call('HINCRBY', d, 'cost_pico_usd', cost)
      redis.call('SADD', p .. 'dailies', d)
    end
    local t = p .. 'totals:' .. inst
    redis.call('HINCRBY', t, 'requests', 1)
    redis.call('HINCRBY', t, 'prompt_tokens', prompt)
    redis.call('HINCRBY', t, 'engine_prompt_tokens', engine)
    redis.call('HINCRBY', t, 'cached_tokens', cached)
    redis.call('HINCRBY', t, 'completion_tokens', compl)
    redis.call('HINCRBY', t, 'reasoning_tokens', reason)
    redis.call('HINCRBY', t, 'billed_micro', billed)
    redis.call('HINCRBY', t, 'cost_pico_usd', cost)
    redis.call('HINCRBY', t, 'status:' .. status, 1)
    redis.call('SADD', p .. 'instances', inst)
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
return out
